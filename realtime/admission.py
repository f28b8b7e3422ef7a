"""Admission by footprint: what one session can hold at its peak, in KV blocks. Pure, no I/O.

A session keeps its KV blocks while it waits for its next chunk, so sessions that together need
more blocks than the pool has deadlock the engine (vllm#49439). Each session therefore reserves
its peak at `session.open` and is refused (`capacity_exceeded`) when the reservations would pass
the pool.

Peak of a bounded session (retention on). Everything the engine holds at any step is

    sinks + window + remnants + the chunk in flight + its reply

* sinks: the union of the first `sink_chunks` chunks and the first `sink_tokens` tokens; the
  first chunk carries the instructions (their exact token count is known at open);
* window: at every fold the policy evicts down to its low watermark whenever the non-sink part
  passes the window, so between folds it holds at most `window_chunks` segments (a segment is a
  chunk plus its kept reply) or `window_tokens` tokens, whichever is smaller;
* remnants: eviction frees whole blocks only (inward rounding), which leaves at most
  `block_size - 1` tokens at the head of the evicted run (sharing a block with the sinks) and
  as many at its tail;
* the chunk in flight is folded AFTER the eviction, then prefilled, then answered.

A consolidation (re-prefill at 0..n-1) frees the session's blocks before it allocates them
again, and a preemption resumes as one, so neither adds to the peak. The engine's table is
compacted (all blocks full but the tail), so blocks = ceil(tokens / block_size).
`tests/realtime/test_admission.py` checks this bound against a simulation of the policy over
random budgets and chunk sizes.

Every chunk has a bounded size for this to hold: text turns and the text part of a frame are
capped by `max_chunk_tokens` (counted exactly, the server tokenizes them), a frame by the
frame cap (`max_frame_pixels`, the server's or the session's lower one: a larger frame is
resized down to it and the processor is told the same cap as its max pixels, so the cap → max
tokens per image, and per clip of at most the session's declared `limits.max_clip_frames`: 1
unless it declares clips, since cameras send single images), instructions by
`max_instructions_tokens`. Published processor configs allow images of 12-16 megapixels
(16,384 tokens): without the cap every session's worst case passed the context.

Compute is admitted too (realtime/compute.py): the open sessions' declared paces times the
measured cost of their chunks must stay under a headroom of the engine's time.

Sessions without retention keep the old rule: max_model_len.

`Admission` applies these rules to a `SessionConfig` with the server's caps and the engine's
facts: what a session reserves at open, and whether a chunk may run. The hub does the I/O
(tokenizing, the engine); everything here is arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from realtime.compute import ChunkKind, CostModel, SessionLoad, compute_problem
from realtime.config import ServerConfig
from realtime.media import MAX_CLIP_FRAMES
from retention.policy import ConsolidationMode
from vllm_realtime_protocol import (
    CapacityExceeded,
    ChunkTooLarge,
    ContextExceeded,
    InvalidRequestError,
    SessionConfig,
)

BUDGET_FIELDS = frozenset(
    {"sink_tokens", "sink_chunks", "window_chunks", "window_tokens", "text_window_tokens"}
)
"""Retention fields a client may set; with `strict_budgets` a budget built from them must fit."""


@dataclass(frozen=True)
class ChunkBounds:
    """The largest chunk a session may send, in tokens, as the server enforces it."""

    chunk_tokens: int  # any chunk, its template, prompt text and media included
    reply_tokens: int  # sampling.max_tokens
    instructions_tokens: int = 0  # the first chunk's system prompt (pinned with it)


@dataclass(frozen=True)
class Footprint:
    """A session's peak, in tokens and blocks, with its parts (for errors and session.opened)."""

    tokens: int
    blocks: int
    sinks: int = 0
    window: int = 0
    remnants: int = 0
    chunk: int = 0
    reply: int = 0

    def describe(self) -> str:
        if not (self.sinks or self.window or self.remnants or self.chunk or self.reply):
            # unbounded_footprint: no parts to add up (a breakdown of zeros read as a bug).
            return f"the whole context, {self.tokens} tokens: no retention bounds it"
        return (
            f"sinks {self.sinks} + window {self.window} + remnants {self.remnants} + chunk "
            f"{self.chunk} + reply {self.reply} = {self.tokens} tokens"
        )


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


def unbounded_footprint(max_model_len: int, block_size: int) -> Footprint:
    """A session without retention may grow to the whole context."""
    return Footprint(tokens=max_model_len, blocks=blocks_for(max_model_len, block_size) + 1)


def _sinks(budget: dict[str, Any], bounds: ChunkBounds) -> tuple[int, int]:
    """Tokens pinned by the sinks (the first chunks with their replies, or `sink_tokens`), and
    the instructions' tokens to count with the window and the chunk in flight instead (without
    sink chunks the first chunk is an ordinary one)."""
    segment = bounds.chunk_tokens + bounds.reply_tokens
    sink_chunks = int(budget.get("sink_chunks") or 0)
    sink_tokens = int(budget.get("sink_tokens") or 0)
    pinned = bounds.instructions_tokens + sink_chunks * segment if sink_chunks else 0
    extra = 0 if sink_chunks else bounds.instructions_tokens
    return max(sink_tokens, pinned), extra


def _footprint(
    sinks: int, window: int, remnants: int, in_flight: int, reply: int, block_size: int
) -> Footprint:
    tokens = sinks + window + remnants + in_flight + reply
    return Footprint(
        tokens=tokens,
        blocks=blocks_for(tokens, block_size),
        sinks=sinks,
        window=window,
        remnants=remnants,
        chunk=in_flight,
        reply=reply,
    )


def bounded_footprint(budget: dict[str, Any], bounds: ChunkBounds, block_size: int) -> Footprint:
    """Peak tokens and blocks of a session with this retention budget (see module docstring).

    `budget` has the keys of `RetentionBudget.from_request_args` (sink_tokens, sink_chunks,
    window_chunks, window_tokens, ...).
    """
    chunk = bounds.chunk_tokens
    reply = bounds.reply_tokens
    text_window = budget.get("text_window_tokens")
    if text_window is not None:
        return _split_footprint(budget, int(text_window), bounds, block_size)
    segment = chunk + reply  # a chunk and its kept reply
    sinks, extra = _sinks(budget, bounds)
    windows: list[int] = []
    if budget.get("window_chunks") is not None:
        windows.append(int(budget["window_chunks"]) * segment + extra)
    if budget.get("window_tokens") is not None:
        windows.append(int(budget["window_tokens"]))
    window = min(windows) if windows else 0
    remnants = 2 * (block_size - 1)
    return _footprint(sinks, window, remnants, chunk + extra, reply, block_size)


def _split_footprint(
    budget: dict[str, Any], text_window: int, bounds: ChunkBounds, block_size: int
) -> Footprint:
    """Peak with a text window: frames and text are kept by budgets of their own.

    * sinks: the first `sink_chunks` chunks with their replies (or `sink_tokens`);
    * frames: at most `window_chunks` frame chunks (no reply: a reply is a text segment) or
      `window_tokens` frame tokens;
    * text: questions, text turns, replies and every remnant, at most `text_window_tokens`
      after the fold's text round, except what the text round cannot free: inward rounding
      leaves at most `block_size - 1` tokens at each end of each run of dropped segments, and
      a run ends only at a held frame or at the sinks, so the text round leaves at most
      `2 × (block_size − 1) × (frames held + 1)` tokens besides the text it keeps;
    * the chunk in flight and its reply.

    With `window_chunks` unset the frames held are bounded by `window_tokens` (a frame is at
    least one token), so that term is large: set `window_chunks` with a text window.
    """
    chunk = bounds.chunk_tokens
    sinks, extra = _sinks(budget, bounds)
    frame_caps: list[int] = []
    held_frames: list[int] = []
    if budget.get("window_chunks") is not None:
        frame_caps.append(int(budget["window_chunks"]) * chunk + extra)
        held_frames.append(int(budget["window_chunks"]))
    if budget.get("window_tokens") is not None:
        frame_caps.append(int(budget["window_tokens"]))
        held_frames.append(int(budget["window_tokens"]))
    frames = min(frame_caps) if frame_caps else 0
    runs = (min(held_frames) if held_frames else 0) + 1
    remnants = 2 * (block_size - 1) * runs
    window = frames + text_window + extra
    return _footprint(sinks, window, remnants, chunk + extra, bounds.reply_tokens, block_size)


def budget_problem(footprint: Footprint, max_position: int, max_model_len: int) -> str | None:
    """Why a bounded session with this footprint cannot run, or None.

    Positions: right after a consolidation the held tokens sit at 0..n-1 and the next chunk and
    its reply follow, so the footprint must fit under max_position. The worker's per-request
    buffer is max_model_len wide, and vLLM needs the prompt below it.
    """
    if footprint.tokens > max_position:
        return (
            f"the retention budget does not fit the model's positions: {footprint.describe()}, "
            f"more than max_position={max_position}; lower the window, the sinks, "
            "sampling.max_tokens or the chunk size"
        )
    if footprint.tokens >= max_model_len:
        return (
            f"the retention budget does not fit the context: {footprint.describe()}, "
            f"not below max_model_len={max_model_len}; lower the window, the sinks or "
            "sampling.max_tokens"
        )
    return None


def _pixel_range(image: dict[str, Any]) -> tuple[int | None, int | None]:
    """(min, max) pixels of a Qwen-VL style image or video processor config: flat
    `min_pixels`/`max_pixels` (Qwen2-VL, Qwen2.5-VL) or `size.shortest_edge`/`longest_edge`,
    which these processors read as pixel counts (Qwen3-VL, transformers 5)."""
    size = image.get("size") or {}
    low = image.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels")
    high = image.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
    return (int(low) if low else None), (int(high) if high else None)


def max_image_tokens(
    processor_config: dict[str, Any], max_frame_pixels: int | None = None
) -> int | None:
    """Most LLM tokens one image can become, from a Qwen-VL style processor config: the
    processor resizes to at most max_pixels, in (patch × merge)² pixel units per token; with a
    frame cap the processor is told the cap as its max_pixels (`processor_kwargs`). Small
    images are scaled up to min_pixels, rounding each side up: twice min_pixels bounds that."""
    image = processor_config.get("image_processor", processor_config)
    low, high = _pixel_range(image)
    patch = image.get("patch_size")
    merge = image.get("merge_size", 1)
    if not high or not patch:
        return None
    if max_frame_pixels is not None:
        high = min(high, max_frame_pixels)
    high = max(high, 2 * (low or 0))
    return math.ceil(high / (int(patch) * int(merge)) ** 2)


def processor_kwargs(
    processor_config: dict[str, Any], max_frame_pixels: int | None
) -> dict[str, Any] | None:
    """vLLM's `mm_processor_kwargs` that tell the image processor the frame cap, so an image
    never becomes more tokens than was reserved: a Qwen-VL style processor's max pixels, an
    Idefics3/SmolVLM one's longest edge (it scales every image to that edge, a small frame up);
    None when the cap does not lower them, or the config is neither."""
    if max_frame_pixels is None:
        return None
    image = processor_config.get("image_processor", processor_config)
    if split_image_tokens(processor_config) is not None:
        tile = int(image["max_image_size"]["longest_edge"])
        longest = int((image.get("size") or {}).get("longest_edge") or tile)
        edge = split_edge(tile, max_frame_pixels)
        return {"size": {"longest_edge": edge}} if edge < longest else None
    low, high = _pixel_range(image)
    if not high or not image.get("patch_size") or high <= max_frame_pixels:
        return None
    size = {"longest_edge": max_frame_pixels}
    if low:
        size["shortest_edge"] = min(low, max_frame_pixels)
    return {"size": size}


@dataclass(frozen=True)
class MediaBounds:
    """Most LLM tokens a frame chunk's media can become (from the processor's max pixels)."""

    image_tokens: int
    clip_frame_tokens: int  # one temporal step of a clip (temporal_patch_size frames)
    temporal_patch: int = 1

    def clip_tokens(self, frames: int) -> int:
        return self.clip_frame_tokens * math.ceil(frames / self.temporal_patch)

    def chunk_tokens(self, max_clip_frames: int) -> int:
        """The largest media of one chunk: an image, or a clip of at most that many frames."""
        return max(self.image_tokens, self.clip_tokens(max_clip_frames))


def split_edge(tile: int, max_frame_pixels: int) -> int:
    """The longest edge an Idefics3/SmolVLM processor is told for a frame cap: the cap's side,
    rounded up to whole tiles (a 448×448 cap: one 512-px tile, the global image alone)."""
    return max(tile, math.ceil(math.sqrt(max_frame_pixels) / tile) * tile)


def split_image_tokens(
    processor_config: dict[str, Any], max_frame_pixels: int | None = None
) -> int | None:
    """Most tokens one image can become with an Idefics3/SmolVLM processor, splitting tokens
    included: the longest edge is resized to `size` (with a frame cap, to `split_edge`, as
    `processor_kwargs` tells the processor), then cut into tiles of `max_image_size` (at most
    ceil(size / tile) per side), each `<fake_token_around_image><row_r_col_c>` and
    `image_seq_len` `<image>` tokens, a newline after each row, a newline, and the global image
    `<fake_token_around_image><global-img>`, `image_seq_len` `<image>`,
    `<fake_token_around_image>`. None: not such a config."""
    image = processor_config.get("image_processor", processor_config)
    seq_len = processor_config.get("image_seq_len")
    tile = (image.get("max_image_size") or {}).get("longest_edge")
    if not seq_len or not tile:
        return None
    longest = int((image.get("size") or {}).get("longest_edge") or tile)
    if max_frame_pixels is not None:
        longest = min(longest, split_edge(int(tile), max_frame_pixels))
    per_side = math.ceil(longest / int(tile)) if image.get("do_image_splitting") else 0
    if per_side <= 1:  # one tile or no splitting: the global image alone
        return int(seq_len) + 3
    tiles = per_side * per_side
    return tiles * (int(seq_len) + 2) + per_side + 1 + int(seq_len) + 3


def media_bounds(
    processor_config: dict[str, Any], max_frame_pixels: int | None = None
) -> MediaBounds | None:
    """A frame's most tokens under the processor config and the frame cap (clips: per frame,
    each resized to the cap)."""
    split = split_image_tokens(processor_config, max_frame_pixels)
    if split is not None:
        # vLLM 0.32 serves Idefics3/SmolVLM with images only: no clip reaches the engine (the
        # server refuses clips where the chat template writes no video placeholder).
        return MediaBounds(image_tokens=split, clip_frame_tokens=0)
    image = max_image_tokens(processor_config, max_frame_pixels)
    video = processor_config.get("video_processor", processor_config)
    per_step = max_image_tokens({"image_processor": video}, max_frame_pixels)
    if image is None or per_step is None:
        return None
    temporal = int(video.get("temporal_patch_size", 1) or 1)
    return MediaBounds(image_tokens=image, clip_frame_tokens=per_step, temporal_patch=temporal)


DEFAULT_MEDIA_BOUNDS = MediaBounds(image_tokens=1024, clip_frame_tokens=1024)
"""Taken when the processor config says nothing about its sizes: large, so admission errs safe."""


def media_bounds_or_default(
    processor_config: dict[str, Any], max_frame_pixels: int | None = None
) -> MediaBounds:
    return media_bounds(processor_config, max_frame_pixels) or DEFAULT_MEDIA_BOUNDS


@dataclass(frozen=True)
class Admitted:
    """What admission reserves for a session."""

    footprint: Footprint
    bounded: bool
    """Whether the reservation is the session's bounded footprint (else a whole context)."""
    whole_context_because: str | None = None
    """Why a retention budget is reserved as a whole context (its worst case does not fit)."""


@dataclass(frozen=True)
class Admission:
    """The server's admission rules: its caps and the engine's facts, applied to sessions."""

    max_model_len: int
    max_position: int
    """The position limit of a bounded session (the model's range, or the server's lower one)."""
    block_size: int
    usable_blocks: int
    max_chunk_tokens: int
    max_clip_frames: int
    max_instructions_tokens: int
    max_sessions: int
    media: MediaBounds | None = None
    """None: the model takes text only."""
    engine_slots: int | None = None
    """The engine's `max_num_seqs`: a paused streaming session keeps its request slot, so more
    sessions than slots starve the extra ones (found by tests/reliability/test_capacity.py)."""
    max_sessions_per_key: int | None = None
    retention_max_position: int | None = None
    """The server's position limit, sent to the engine with every budget (None: the model's)."""
    consolidation: ConsolidationMode | None = None
    """The server's consolidation mode, sent with every budget (None: the engine's default)."""
    strict_budgets: bool = False
    compute_headroom: float | None = None
    """Share of the engine's time the open sessions may ask for (None: compute not admitted)."""
    max_frame_pixels: int | None = None
    """The server's frame cap (a larger frame is resized down to it); None: no cap."""
    processor_config: dict[str, Any] = field(default_factory=dict)
    """The model's processor config: a session's own frame cap reserves from it."""

    @classmethod
    def for_server(
        cls,
        server: ServerConfig,
        *,
        max_model_len: int,
        max_position: int,
        block_size: int,
        usable_blocks: int,
        media: MediaBounds | None,
        engine_slots: int | None,
        processor_config: dict[str, Any] | None = None,
    ) -> Admission:
        """The rules of a server with this configuration over an engine with these facts."""
        return cls(
            max_model_len=max_model_len,
            max_position=max_position,
            block_size=block_size,
            usable_blocks=usable_blocks,
            max_chunk_tokens=server.max_chunk_tokens,
            max_clip_frames=MAX_CLIP_FRAMES,
            max_instructions_tokens=server.max_instructions_tokens,
            max_sessions=server.max_sessions,
            media=media,
            engine_slots=engine_slots,
            max_sessions_per_key=server.max_sessions_per_key,
            retention_max_position=server.retention_max_position,
            consolidation=server.consolidation,
            strict_budgets=server.strict_budgets,
            compute_headroom=server.compute_headroom,
            max_frame_pixels=server.max_frame_pixels,
            processor_config=processor_config or {},
        )

    # -- session.open

    def retention_args(self, config: SessionConfig | None) -> dict[str, Any] | None:
        """The engine budget (`extra_args["streaming_retention"]`) of a session, if bounded."""
        if config is None or not config.retention.enabled:
            return None
        r = config.retention
        args: dict[str, Any] = {"sink_tokens": r.sink_tokens, "sink_chunks": r.sink_chunks}
        if r.window_chunks is not None:
            args["window_chunks"] = r.window_chunks
        if r.window_tokens is not None:
            args["window_tokens"] = r.window_tokens
        if r.text_window_tokens is not None:
            args["text_window_tokens"] = r.text_window_tokens
        if self.retention_max_position is not None:
            args["max_position"] = self.retention_max_position
        if self.consolidation is not None:
            args["consolidation"] = self.consolidation
        return args

    def check_session_counts(self, open_sessions: int, owner_sessions: int) -> None:
        """Refuse a session over the server's, the engine's or the owner's session count."""
        if open_sessions >= self.max_sessions:
            raise CapacityExceeded(
                f"{open_sessions} sessions are open; this server runs at most {self.max_sessions}"
            )
        if self.engine_slots is not None and open_sessions >= self.engine_slots:
            raise CapacityExceeded(
                f"{open_sessions} sessions are open; the engine runs at most "
                f"{self.engine_slots} requests (max_num_seqs)"
            )
        per_key = self.max_sessions_per_key
        if per_key is not None and owner_sessions >= per_key:
            raise CapacityExceeded(
                f"this API key holds {owner_sessions} sessions; at most {per_key} per key"
            )

    def check_instructions(self, tokens: int) -> None:
        if tokens > self.max_instructions_tokens:
            raise InvalidRequestError(
                f"session.open.instructions is {tokens} tokens; at most "
                f"{self.max_instructions_tokens} (limits.max_instructions_tokens)"
            )

    def check_limits(self, config: SessionConfig) -> None:
        """A session's own limits may only lower the server's."""
        server = {
            "max_chunk_tokens": self.max_chunk_tokens,
            "max_clip_frames": self.max_clip_frames,
            "max_frame_pixels": self.max_frame_pixels,
        }
        for name, cap in server.items():
            value = getattr(config.limits, name)
            if cap is None:
                continue
            if value is not None and value > cap:
                raise InvalidRequestError(
                    f"session.open.limits.{name} is {value}, above the server's "
                    f"limits.{name} ({cap})"
                )

    def chunk_caps(self, config: SessionConfig) -> tuple[int, int]:
        """The session's caps: tokens of a chunk's text (its own `limits`, else the server's),
        frames of a clip (what it declared: 1, single images, unless it declared clips)."""
        text = config.limits.max_chunk_tokens or self.max_chunk_tokens
        return text, config.limits.max_clip_frames

    def frame_cap(self, config: SessionConfig) -> int | None:
        """Most pixels of one of this session's frames: its own cap, else the server's."""
        own = config.limits.max_frame_pixels
        if own is None:
            return self.max_frame_pixels
        return own if self.max_frame_pixels is None else min(own, self.max_frame_pixels)

    def media_of(self, config: SessionConfig) -> MediaBounds | None:
        """The media bounds of this session's frames (a session's own cap may lower them)."""
        cap = config.limits.max_frame_pixels
        if self.media is None or cap is None or not self.processor_config:
            return self.media
        return media_bounds(self.processor_config, self.frame_cap(config)) or self.media

    def frame_processor_kwargs(self, config: SessionConfig) -> dict[str, Any] | None:
        """The `mm_processor_kwargs` of this session's frames (None: the engine's own)."""
        return processor_kwargs(self.processor_config, self.frame_cap(config))

    def media_tokens(self, config: SessionConfig) -> int:
        """Most tokens one frame's image or clip of this session can add."""
        media = self.media_of(config)
        if config.modality != "video" or media is None:
            return 0
        return media.chunk_tokens(self.chunk_caps(config)[1])

    def chunk_tokens_cap(self, config: SessionConfig) -> int:
        """Most tokens one chunk of this session can be (text cap, plus a frame's tokens)."""
        return self.chunk_caps(config)[0] + self.media_tokens(config)

    def footprint(self, config: SessionConfig, *, instructions_tokens: int) -> Footprint:
        """The session's peak in tokens and blocks, as its budget alone gives it."""
        budget = self.retention_args(config)
        if budget is None:
            return unbounded_footprint(self.max_model_len, self.block_size)
        bounds = ChunkBounds(
            chunk_tokens=self.chunk_tokens_cap(config),
            reply_tokens=config.sampling.max_tokens,
            instructions_tokens=instructions_tokens,
        )
        return bounded_footprint(budget, bounds, self.block_size)

    def admit(self, config: SessionConfig, *, instructions_tokens: int) -> Admitted:
        """What admission reserves for a session.

        A budget whose worst case (sinks + window + remnants + every chunk at its cap + reply)
        passes max_position or max_model_len is reserved as a whole context, as an unbounded
        session is; with `strict_budgets` a budget the client set is refused instead
        (invalid_request, naming the numbers). Refusing by default refused every default-size
        video session on small contexts: a 16-frame clip at max pixels is 512 tokens.
        """
        self.check_limits(config)
        fp = self.footprint(config, instructions_tokens=instructions_tokens)
        if self.retention_args(config) is None:
            return Admitted(fp, bounded=False)
        problem = budget_problem(fp, self.max_position, self.max_model_len)
        if problem is None:
            return Admitted(fp, bounded=True)
        if self.strict_budgets and config.retention.model_fields_set & BUDGET_FIELDS:
            raise InvalidRequestError(f"session.open.retention: {problem}")
        # Its worst case (every chunk at its cap) does not fit: reserve the whole context; the
        # engine ends the session (context_length_exceeded) if its real chunks ever do not fit
        # after an eviction and a consolidation.
        whole = unbounded_footprint(self.max_model_len, self.block_size)
        return Admitted(whole, bounded=False, whole_context_because=problem)

    def check_pool(self, footprint: Footprint, reserved_blocks: int, open_sessions: int) -> None:
        """Refuse a session whose reservation the pool's unreserved blocks cannot hold."""
        free = self.usable_blocks - reserved_blocks
        if footprint.blocks > free:
            raise CapacityExceeded(
                f"the engine's KV cache cannot hold another session: this one needs "
                f"{footprint.blocks} blocks of {self.block_size} tokens ({footprint.describe()}), "
                f"but only {max(free, 0)} of {self.usable_blocks} are not reserved by the "
                f"{open_sessions} open sessions; a smaller window or max_tokens needs less"
            )

    # -- one chunk

    def check_chunk(
        self,
        config: SessionConfig,
        *,
        text_tokens: int,
        clip_frames: int | None,
        is_frame: bool,
        held_tokens: int,
    ) -> None:
        """Refuse a chunk larger than admission assumed, or one the context cannot take.

        `text_tokens`: the chunk's prompt text, template included (the instructions of a first
        chunk excluded: counted at open); a frame's image or clip adds at most what the
        processor's max pixels give, a clip no more frames than the session's cap.
        `held_tokens`: what the session held at its last boundary."""
        cap, clip_cap = self.chunk_caps(config)
        media = self.media_of(config)
        if text_tokens > cap:
            raise ChunkTooLarge(
                f"this chunk's text is {text_tokens} tokens; at most {cap} "
                "(limits.max_chunk_tokens). It was not run; send it in smaller pieces"
            )
        if (
            clip_frames is not None
            and media is not None
            and media.clip_tokens(clip_frames) > media.chunk_tokens(clip_cap)
        ):
            raise ChunkTooLarge(
                f"this clip has {clip_frames} frames; this session declared at most {clip_cap} "
                f"(session.open.limits.max_clip_frames; a session that declares none sends "
                f"single images, up to the server's {self.max_clip_frames}). It was not run; "
                "send shorter clips, or open a session that declares its clips"
            )
        if self.retention_args(config) is not None:
            # Bounded: the engine checks what the session holds after this fold's eviction
            # (a budget chosen by the client was also checked to fit at open).
            return
        chunk = text_tokens + (self.media_tokens(config) if is_frame else 0)
        need = held_tokens + chunk + config.sampling.max_tokens
        if need > self.max_model_len:
            raise ContextExceeded(
                f"this chunk would take the session to about {need} tokens; the model's "
                f"context is {self.max_model_len}"
            )

    # -- compute

    def session_load(self, config: SessionConfig, costs: CostModel) -> SessionLoad | None:
        """What a session asks of the engine: its declared pace times the cost of one of its
        chunks (a declared clip's prefill scaled by its tokens over an image's); None before
        its kind of chunk was ever measured."""
        kind: ChunkKind = "frame" if config.modality == "video" else "text"
        cost = costs.cost(kind)
        if cost is None:
            return None
        scale = 1.0
        media = self.media_of(config)
        if kind == "frame" and media is not None:
            scale = media.chunk_tokens(self.chunk_caps(config)[1]) / media.chunk_tokens(1)
        tokens = config.sampling.max_tokens
        return SessionLoad(
            frames_per_s=config.limits.frames_per_s,
            chunk_ms=cost.chunk_ms(tokens, prefill_scale=scale),
            solo_ms=cost.solo_ms(tokens, prefill_scale=scale),
        )

    def check_compute(
        self, config: SessionConfig, open_configs: list[SessionConfig], costs: CostModel
    ) -> None:
        """Refuse a session whose frames the engine's time cannot take beside the open ones'."""
        if self.compute_headroom is None:
            return
        new = self.session_load(config, costs)
        if new is None:
            return  # nothing measured yet (the server measures at start-up)
        loads = [self.session_load(c, costs) for c in open_configs]
        problem = compute_problem(
            (load for load in loads if load is not None), new, self.compute_headroom
        )
        if problem is not None:
            raise CapacityExceeded(problem)
