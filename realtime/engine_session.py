"""One session = one resumable vLLM request, fed one chunk at a time.

Theory of operation: the session owns an async generator of `StreamingInput` that vLLM's
streaming-input path consumes. A chunk is put on an internal queue only when the previous chunk's
reply has reached its boundary (an output with a finish reason on a request that is not
finished), so the producer can never get ahead of the consumer and DELTA outputs of two chunks are
never merged. `finished=True` is terminal: it means the engine ended the request (abort, error,
end of input), never a chunk boundary.

What the session holds comes back on the reply itself: the output that closes a chunk carries
EngineCore's `SessionReport` (retention/records.py), and an engine-side end carries one with its
error code. vLLM's errors are mapped to protocol errors here, once (`_engine_failure`): nothing
above this module sees a vLLM exception or parses a vLLM string.

Idle consolidation (bounded sessions): when the report on a chunk's boundary says the next chunk
would consolidate on its own path (`consolidate_when_idle`), the session sends a control chunk
at once, in a background task, while the client reads the reply and prepares its next chunk
(retention/vllm_adapter/eviction.py: the engine drops the control's tokens and re-prefills the
window). The next `run_chunk` first waits for that control chunk's boundary, so one chunk is in
flight at a time and a chunk that arrives during the consolidation runs right after it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import io
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from realtime.media import decode_clip, decode_image
from realtime.prompt_format import ChatFormat, ChatFormatError
from realtime.structured import validate_format
from retention.policy import (
    CHUNK_HEAD_KEY,
    CHUNK_KIND_KEY,
    CONSOLIDATE,
    CONTROL_KEY,
    REPORT_KEY,
    REQUEST_ARGS_KEY,
    RESTORE_KEY,
    SNAPSHOT_KEY,
    idle_time_suffices,
)
from retention.records import CONTEXT_LENGTH_EXCEEDED, SessionReport, SessionSnapshot
from retention.vllm_adapter.rendering import render_prompt
from vllm_realtime_protocol import (
    ContextExceeded,
    EngineError,
    Frame,
    FrameResize,
    InvalidEvent,
    JsonObjectFormat,
    JsonSchemaFormat,
    RealtimeError,
    ResponseFormat,
    SamplingConfig,
    SessionConfig,
)


def structured_outputs(fmt: ResponseFormat | None) -> Any:
    """vLLM's StructuredOutputsParams for a reply format; None for free text (here, beside the
    engine, so that realtime/structured.py validates formats without importing vLLM)."""
    from vllm.sampling_params import StructuredOutputsParams

    if isinstance(fmt, JsonSchemaFormat):
        # Compact JSON: with free whitespace a weak model can pad a reply until max_tokens.
        return StructuredOutputsParams(json=fmt.json_schema.schema_, disable_any_whitespace=True)
    if isinstance(fmt, JsonObjectFormat):
        return StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    return None


@dataclass(frozen=True)
class EngineFacts:
    """What the session layer needs to know about the engine, read once at start-up."""

    max_model_len: int
    multimodal: bool
    max_position: int
    """The model's trained RoPE range (else max_model_len): the retention position limit."""
    engine_slots: int | None
    """The engine's `max_num_seqs`: a paused streaming session keeps its slot."""
    model_path: str
    processor_config: dict[str, Any]
    """The model's (pre)processor config ({} if none): its max pixels bound a frame's tokens."""
    frame_pad_ids: dict[str, int] | None = None
    """The model's placeholder token per frame kind, where its video sessions can be stored
    (`storable_frames`); None: text only, or frames a rebuild cannot pass again."""
    kv_cache_memory_bytes: int | None = None
    """`--kv-cache-memory-bytes` as the engine took it (None: sized from GPU/CPU memory)."""

    @classmethod
    def of(cls, engine: Any) -> EngineFacts:
        from retention.vllm_adapter.session_scheduler import model_max_position

        model_config = engine.model_config
        vllm_config = getattr(engine, "vllm_config", None)
        scheduler_config = getattr(vllm_config, "scheduler_config", None)
        cache_config = getattr(vllm_config, "cache_config", None)
        model_path = str(model_config.model)
        multimodal = bool(model_config.is_multimodal_model)
        return cls(
            max_model_len=int(model_config.max_model_len),
            multimodal=multimodal,
            max_position=model_max_position(model_config),
            engine_slots=getattr(scheduler_config, "max_num_seqs", None),
            model_path=model_path,
            processor_config=read_processor_config(model_path),
            frame_pad_ids=storable_frames(engine) if multimodal else None,
            kv_cache_memory_bytes=getattr(cache_config, "kv_cache_memory_bytes", None) or None,
        )


def read_processor_config(model_path: str) -> dict[str, Any]:
    """The processor config of a local model directory ({} when it has none), in one layout:
    `image_processor`, `video_processor` and the processor's own keys. Published checkpoints
    keep the image processor in `preprocessor_config.json`, the video one in
    `video_preprocessor_config.json` and only the processor's keys (SmolVLM's `image_seq_len`)
    in `processor_config.json`; the embedded models nest all three in `processor_config.json`."""
    config: dict[str, Any] = {}
    for name, key in (
        ("preprocessor_config.json", "image_processor"),
        ("video_preprocessor_config.json", "video_processor"),
    ):
        path = Path(model_path) / name
        if path.is_file():
            config[key] = json.loads(path.read_text())
    path = Path(model_path) / "processor_config.json"
    if path.is_file():
        config.update(json.loads(path.read_text()))
    if "image_processor" in config and "video_processor" not in config:
        # Qwen2-VL's published layout: one preprocessor config for images and clips.
        config["video_processor"] = config["image_processor"]
    return config


@dataclass(frozen=True)
class KvPool:
    """The engine's KV pool, from EngineCore (one call at start-up)."""

    block_size: int
    usable_blocks: int
    kv_cache_groups: int


def served_model_family(engine: Any) -> tuple[str, str]:
    """The engine's model family and its position scheme, if the engine hooks cover it; else
    ``UncoveredModelFamily`` naming the family and why (retention/vllm_adapter/model_families)."""
    from retention.vllm_adapter.model_families import check_model_family

    family = check_model_family(engine.model_config)
    return family.family, family.positions


async def kv_pool(engine: Any) -> KvPool:
    from retention.vllm_adapter.introspect import kv_stats

    stats = await kv_stats(engine)
    return KvPool(
        block_size=int(stats["block_size"]),
        usable_blocks=int(stats["num_usable_blocks"]),
        kv_cache_groups=int(stats["num_kv_cache_groups"]),
    )


@dataclass
class ChunkDelta:
    text: str


@dataclass
class ChunkFinished:
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    ttft_ms: float | None
    total_ms: float
    report: SessionReport | None = None


@dataclass(frozen=True)
class ChunkWriting:
    """How this server writes a chunk's prompt: the model's chat format, whether it takes
    frames, and the tokens of the turn close that a chunk after an answered one starts with."""

    chat: ChatFormat
    multimodal: bool
    reply_close_tokens: int

    @classmethod
    def of(cls, chat: ChatFormat, tokenizer: Any, *, multimodal: bool) -> ChunkWriting:
        close = (
            len(tokenizer.encode(chat.assistant_close, add_special_tokens=False))
            if tokenizer is not None
            else 0
        )
        return cls(chat, multimodal, close)


@dataclass(frozen=True)
class FrameLimits:
    """A session's frame cap (pixels), and the processor kwargs that tell vLLM the same cap."""

    max_frame_pixels: int | None = None
    processor_kwargs: dict[str, Any] | None = None


@dataclass(frozen=True)
class TurnResult:
    """One chunk's run: its text, the engine's ChunkFinished (None when it failed), the frame's
    resize, the milliseconds before it reached the engine, and the error that failed it."""

    text: str
    finished: ChunkFinished | None
    resized: FrameResize | None
    queue_ms: float
    error: RealtimeError | None = None


ChunkMeter = Callable[[], AbstractContextManager[Callable[[ChunkFinished], None]]]
"""Wraps one chunk's time in the engine; what it yields is told the chunk's ChunkFinished."""


def load_chat_template(chat_template: str) -> str:
    """`serve --chat-template`, as vLLM reads it: a file's text, else the template itself."""
    path = Path(chat_template).expanduser()
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # a template's text may be no valid path at all
        pass
    if not any(c in chat_template for c in "{}\n"):
        raise ChatFormatError(f"--chat-template {chat_template!r}: no such file")
    return chat_template


def chat_format_of(engine: Any, chat_template: str | None = None) -> ChatFormat:
    """The served model's chat format: registered for an embedded model, else split from the
    chat template (`chat_template`: `serve --chat-template`; else the one vLLM resolves for the
    model, the processor's or the tokenizer's). Raises ChatFormatError, naming the model and
    what to pass, when none gives one: the server must not start."""
    from realtime.models import registered_chat_format

    model = str(engine.model_config.model)
    registered = registered_chat_format(model) if chat_template is None else None
    if registered is not None:
        return registered
    from vllm.renderers.hf import resolve_chat_template

    tokenizer = engine.get_tokenizer()
    given = load_chat_template(chat_template) if chat_template is not None else None
    template = resolve_chat_template(tokenizer, given, None, model_config=engine.model_config)
    if template is None:
        raise ChatFormatError(
            f"{model} has no chat template to write its prompts with; pass one with "
            "--chat-template FILE"
        )

    def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        text = tokenizer.apply_chat_template(
            messages,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
        )
        return str(text)

    # A template that writes the BOS token the tokenizer adds itself would write it twice.
    bos = getattr(tokenizer, "bos_token", None)
    adds_bos = bool(bos) and tokenizer.encode("x")[:1] == [tokenizer.bos_token_id]
    try:
        return ChatFormat.from_template(render, strip_prefix=bos if adds_bos else None)
    except ChatFormatError as exc:
        raise ChatFormatError(
            f"{model}: {exc}; pass a template whose turns split (--chat-template FILE)"
        ) from None


def render_chunk(
    frame: Frame,
    config: SessionConfig,
    *,
    chat: ChatFormat,
    first: bool,
    multimodal: bool,
    after_reply: bool | None = None,
    max_frame_pixels: int | None = None,
    processor_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The engine prompt for one chunk, in the served model's chat format (`chat`).

    An answered chunk ends by opening an assistant turn; its reply fills it. vLLM drops the last
    sampled token of a chunk from the cached context, so that turn is still open when the next
    chunk comes, and the next chunk closes it first (`after_reply`, by default: any chunk but
    the first). An ingested chunk (`frame.reply` false) is a user turn only, closed: the one
    token the engine samples to end it never enters the context, so nothing is left open and
    the next chunk starts straight with its own turn. N ingested frames and a question are
    thus N + 1 consecutive user turns, then the assistant's.

    A frame over `max_frame_pixels` is resized down to it; the prompt then says so under
    `RESIZED_KEY` (a `FrameResize`, for response.done; the caller pops it). `processor_kwargs`:
    the frame's `mm_processor_kwargs` (the same cap, told to the processor)."""
    if after_reply is None:
        after_reply = not first
    mm: dict[str, Any] = {}
    resized: FrameResize | None = None
    content = "" if frame.kind != "text" else frame.text or ""
    if frame.prompt:
        content += ("\n" if frame.kind == "text" else "") + frame.prompt
    media = None if frame.kind == "text" else frame.kind
    if media is not None:
        if media == "image":
            mm[media] = decode_image(frame.data, max_pixels=max_frame_pixels)
            sizes = _image_size(frame.data), mm[media].size
        else:
            mm[media] = decode_clip(frame.data, max_frame_pixels=max_frame_pixels)
            sizes = _clip_size(frame.data), tuple(reversed(mm[media][0].shape[1:3]))
        if sizes[0] is not None and tuple(sizes[0]) != tuple(sizes[1]):
            resized = FrameResize(
                from_size=sizes[0], to_size=sizes[1], max_frame_pixels=max_frame_pixels or 1
            )
        if not multimodal:
            raise InvalidEvent("this server's model takes text only; open a 'text' session")
        if (chat.image if media == "image" else chat.video) is None:
            raise InvalidEvent(f"this server's model takes no {media} frames (its chat template)")
    text = chat.chunk(
        content,
        media=media,
        instructions=config.instructions if first else None,
        first=first,
        close_reply=after_reply and not first,
        reply=frame.reply,
    )
    prompt: dict[str, Any] = {"prompt": text}
    if mm:
        prompt["multi_modal_data"] = mm
        if processor_kwargs:
            prompt["mm_processor_kwargs"] = processor_kwargs
    if resized is not None:
        prompt[RESIZED_KEY] = resized
    return prompt


RESIZED_KEY = "vllm_realtime_resized"
"""Where `render_chunk` says a frame was resized (popped before the prompt reaches vLLM)."""


def _image_size(data: bytes) -> tuple[int, int] | None:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:  # decoded before: it opens
        return img.width, img.height


def _clip_size(data: bytes) -> tuple[int, int] | None:
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        return stream.codec_context.width, stream.codec_context.height


def whole_chunks(snapshot: SessionSnapshot) -> SessionSnapshot:
    """`snapshot` without its remnants (pieces of chunks cut by block-aligned eviction): what
    an mRoPE consolidation re-prefills (retention/vllm_adapter/eviction.py drops them first;
    a remnant may hold placeholder tokens of a frame the engine already dropped)."""
    if not any(seg[4] for seg in snapshot.segments):
        return snapshot
    tokens: list[int] = []
    segments = []
    start = 0
    for seg in snapshot.segments:
        end = start + seg[2]
        if not seg[4]:
            tokens += snapshot.token_ids[start:end]
            segments.append(seg)
        start = end
    return dataclasses.replace(snapshot, token_ids=tokens, segments=segments)


def media_prompt(
    snapshot: SessionSnapshot,
    media: Mapping[int, tuple[str, Any]],
    pad_ids: Mapping[str, int],
) -> tuple[list[int], dict[str, list[Any]]]:
    """The rebuild prompt of a video session: its held tokens with each frame's run of
    placeholder pads collapsed to one pad (vLLM's processor expands it again from the frame),
    and the frames as `multi_modal_data`, each modality in prompt order. Raises
    `EngineError` for a whole segment that holds pads but no stored frame."""
    pads = set(pad_ids.values())
    ids: list[int] = []
    mm: dict[str, list[Any]] = {}
    start = 0
    for seg in snapshot.segments:
        index, n = seg[0], seg[2]
        piece = snapshot.token_ids[start : start + n]
        start += n
        item = media.get(index)
        if item is None:
            if pads.intersection(piece):
                raise EngineError(f"segment {index} holds a frame the record does not")
            ids += piece
            continue
        kind, data = item
        pad = pad_ids[kind]
        for token in piece:
            if token != pad or not ids or ids[-1] != pad:
                ids.append(token)
        mm.setdefault(kind, []).append(data)
    return ids, mm


def _engine_failure(
    exc: BaseException | None = None,
    report: SessionReport | None = None,
    finish_reason: str | None = None,
) -> RealtimeError:
    """The protocol error for a session the engine ended (or refused), decided in one place."""
    if exc is not None:
        from vllm.exceptions import VLLMValidationError

        if isinstance(exc, VLLMValidationError) and exc.parameter in ("input_text", "input_tokens"):
            # vLLM refuses a prompt longer than the model's context before running it. That is
            # the client's chunk, not an engine failure: it used to surface as a fatal
            # engine_error (found by tests/reliability: long text turns, prompts).
            return ContextExceeded(
                "this chunk does not fit in the model's context; send smaller chunks"
            )
        return EngineError(f"engine failed: {type(exc).__name__}")
    if report is not None and report.error == CONTEXT_LENGTH_EXCEEDED:
        return ContextExceeded(
            "the session reached the model's context length; open a new session or enable retention"
        )
    why = report.error if report is not None and report.error else finish_reason
    return EngineError(f"the engine ended this session ({why})")


def _session_params(sampling: SamplingConfig, *, ignore_eos: bool) -> Any:
    """The SamplingParams every chunk of a session starts from (`chunk_params` clones it)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=sampling.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
        ignore_eos=ignore_eos,
        output_kind=RequestOutputKind.DELTA,
        skip_clone=False,
    )


class EngineSession:
    """The engine side of one session. Not thread-safe; one chunk at a time by construction."""

    def __init__(
        self,
        engine: Any,
        request_id: str,
        sampling: SamplingConfig,
        retention: dict[str, Any] | None = None,
        *,
        ignore_eos: bool = False,
        idle_consolidation: bool = True,
        adapt_idle_to_client: bool = True,
        snapshots: bool = False,
    ) -> None:
        """`retention`: the engine budget (`extra_args["streaming_retention"]`), if bounded.
        `ignore_eos`: replies always run to max_tokens (benchmarks, for comparable turns).
        `idle_consolidation`: consolidate between chunks when the engine asks (bounded
        sessions); False leaves every consolidation on a chunk's path (benchmarks).
        `adapt_idle_to_client`: skip an idle consolidation the client's recent gaps leave no time
        for (`retention.policy.idle_time_suffices`); False: always consolidate while idle.
        `snapshots`: every chunk boundary's report carries the session's `SessionSnapshot`
        (bounded sessions kept in a session store, realtime/session_store.py)."""
        self.engine = engine
        self.request_id = request_id
        self._inputs: asyncio.Queue[object] = asyncio.Queue()
        self._outputs: AsyncIterator[Any] | None = None
        self._ignore_eos = ignore_eos
        self._sampling_params = _session_params(sampling, ignore_eos=ignore_eos)
        # Every session, bounded or not, asks for the report: it is what the session holds.
        self._sampling_params.extra_args = {REPORT_KEY: True}
        if retention is not None:
            self._sampling_params.extra_args[REQUEST_ARGS_KEY] = retention
            if snapshots:
                self._sampling_params.extra_args[SNAPSHOT_KEY] = True
        self.bounded = retention is not None
        self.idle_consolidation = idle_consolidation and self.bounded
        # The control chunk in flight (idle consolidation), and how many ran.
        self._idle_task: asyncio.Task[None] | None = None
        self.idle_consolidations = 0
        # Consolidations left to the next chunk's path because the client's recent idle gaps
        # were shorter than the last one took (`retention.policy.idle_time_suffices`).
        self.idle_consolidations_skipped = 0
        self._recent_gaps_s: collections.deque[float] = collections.deque(maxlen=8)
        self._last_consolidation_s: float | None = None
        self._boundary_at: float | None = None
        self.adapt_idle_to_client = adapt_idle_to_client
        self.prompt_tokens_total = 0
        self.chunks = 0
        self.finished = False
        # EngineCore's reports: the last chunk boundary's, and the one that ended the session.
        # They are the one source of what the session holds (no count is kept here).
        self.boundary_report: SessionReport | None = None
        self.end_report: SessionReport | None = None
        # Whether the last chunk was answered: its assistant turn is then still open (the last
        # sampled token is not in the context) and the next chunk must close it.
        self.turn_open = False

    def update_sampling(self, sampling: SamplingConfig) -> None:
        """Later chunks sample with `sampling` (session.update); the chunk in flight keeps the
        params it was fed with (each chunk gets a clone, `chunk_params`)."""
        # A new SamplingParams, not edited fields: its __post_init__ normalizes greedy
        # sampling (temperature 0) and checks the values, as at open.
        extra_args = self._sampling_params.extra_args
        self._sampling_params = _session_params(sampling, ignore_eos=self._ignore_eos)
        self._sampling_params.extra_args = extra_args

    def chunk_params(
        self,
        *,
        reply: bool,
        response_format: ResponseFormat | None = None,
        kind: str | None = None,
        head: int = 0,
    ) -> Any:
        """The SamplingParams of one chunk: the session's, with the grammar of this chunk's
        `response_format` (checked by the caller); an ingested chunk samples one token, which
        the next fold drops (no phantom tokens).
        `kind` ("text" or "frame") tells the engine's retention which budget keeps the chunk
        (`retention.text_window_tokens`); `head`: how many leading tokens close the previous
        reply's turn (kept with that reply)."""
        params = self._sampling_params.clone()
        if kind is not None:
            params.extra_args = {
                **(params.extra_args or {}),
                CHUNK_KIND_KEY: kind,
                CHUNK_HEAD_KEY: head,
            }
        params.structured_outputs = structured_outputs(response_format) if reply else None
        if not reply:
            params.max_tokens = 1
            params.min_tokens = 0
            params.logprobs = None
        return params

    async def run_turn(
        self,
        frame: Frame,
        config: SessionConfig,
        writing: ChunkWriting,
        *,
        frames: FrameLimits | None = None,
        on_delta: Callable[[str], Awaitable[None]] | None = None,
        check: Callable[[dict[str, Any]], None] | None = None,
        meter: ChunkMeter | None = None,
        reply_tokens: int | None = None,
    ) -> TurnResult:
        """Run one accepted chunk: its sampling params, its prompt (`render_chunk`, in a
        thread), `check(prompt)` (the caller's caps), then the engine; each delta's text goes to
        `on_delta`. A protocol error (a refused format or prompt, the engine failing) is the
        result's `error`, not raised. `reply_tokens`: a fixed reply length (calibration)."""
        started = time.perf_counter()
        parts: list[str] = []
        resized: FrameResize | None = None
        finished: ChunkFinished | None = None
        queue_ms = 0.0
        try:
            params = self._turn_params(frame, config, writing)
            if reply_tokens is not None:
                params.max_tokens = params.min_tokens = reply_tokens
            limits = frames or FrameLimits()
            prompt = await asyncio.to_thread(
                render_chunk,
                frame,
                config,
                chat=writing.chat,
                first=self.chunks == 0,
                multimodal=writing.multimodal,
                after_reply=self.turn_open,
                max_frame_pixels=limits.max_frame_pixels,
                processor_kwargs=limits.processor_kwargs,
            )
            resized = prompt.pop(RESIZED_KEY, None)
            if check is not None:
                check(prompt)
            queue_ms = (time.perf_counter() - started) * 1e3
            with meter() if meter is not None else contextlib.nullcontext(None) as observe:
                async for item in self.run_chunk(prompt, params, reply=frame.reply):
                    if isinstance(item, ChunkDelta):
                        parts.append(item.text)
                        if on_delta is not None:
                            await on_delta(item.text)
                    else:
                        finished = item
                        if observe is not None:
                            observe(item)
        except RealtimeError as exc:
            return TurnResult("".join(parts), None, resized, queue_ms, exc)
        return TurnResult("".join(parts), finished, resized, queue_ms)

    def _turn_params(self, frame: Frame, config: SessionConfig, writing: ChunkWriting) -> Any:
        """This chunk's SamplingParams: an ingested chunk samples one (dropped) token; an
        answered one takes its own response_format, else the session's (checked at open)."""
        # With retention.text_window_tokens: a question or text turn that is answered, and its
        # reply, are text; frames and every ingested chunk (watched) follow the frame window.
        kind = "text" if frame.kind == "text" and frame.reply else "frame"
        head = writing.reply_close_tokens if self.turn_open else 0
        if not frame.reply:
            return self.chunk_params(reply=False, kind=kind, head=head)
        fmt = config.sampling.response_format
        if frame.response_format is not None:
            fmt = frame.response_format
            validate_format(fmt, "frame.append.response_format")
        return self.chunk_params(reply=True, response_format=fmt, kind=kind, head=head)

    async def _input_stream(self) -> AsyncIterator[Any]:
        # Never ends by itself: a session ends by abort (see `abort`), not by end of input.
        while True:
            yield await self._inputs.get()

    async def run_chunk(
        self, prompt: dict[str, Any], params: Any = None, *, reply: bool = True
    ) -> AsyncIterator[ChunkDelta | ChunkFinished]:
        """Feed one chunk and yield its deltas, then exactly one ChunkFinished.

        `params`: this chunk's SamplingParams (None: the session's). `reply=False`: an ingested
        chunk; the token sampled to end it is neither yielded nor counted in ChunkFinished."""
        from vllm.engine.protocol import StreamingInput

        started = time.perf_counter()
        if self._boundary_at is not None:
            self._recent_gaps_s.append(started - self._boundary_at)
            self._boundary_at = None
        await self._wait_idle_consolidation()
        if self.finished:
            raise EngineError("the engine ended this session")
        rendered = await render_prompt(self.engine, prompt)
        self._inputs.put_nowait(StreamingInput(prompt=rendered, sampling_params=params))
        if self._outputs is None:
            self._outputs = self.engine.generate(
                self._input_stream(), self._sampling_params, request_id=self.request_id
            )
        first_token: float | None = None
        completion = 0
        while True:
            out = await self._next_output()
            completion_out = out.outputs[0] if out.outputs else None
            if completion_out is not None and completion_out.token_ids:
                if first_token is None:
                    first_token = time.perf_counter()
                completion += len(completion_out.token_ids)
                if completion_out.text and reply:
                    yield ChunkDelta(completion_out.text)
            report = SessionReport.from_wire(out.kv_transfer_params)
            if out.finished:
                # Terminal: engine-initiated abort/error or end of input, never a boundary.
                raise self._ended(report, completion_out)
            if completion_out is not None and completion_out.finish_reason is not None:
                if self.bounded:
                    # The front end keeps only this chunk's prompt for a bounded session
                    # (retention/vllm_adapter/streaming.py, e).
                    prompt_tokens = len(out.prompt_token_ids or [])
                else:
                    cumulative = len(out.prompt_token_ids or [])
                    prompt_tokens = max(0, cumulative - self.prompt_tokens_total)
                self.prompt_tokens_total += prompt_tokens
                self.chunks += 1
                self.turn_open = reply
                if report is not None:
                    self.boundary_report = report
                if (
                    self.idle_consolidation
                    and report is not None
                    and report.retention is not None
                    and report.retention.consolidate_when_idle
                ):
                    if not self.adapt_idle_to_client or idle_time_suffices(
                        self._recent_gaps_s, self._last_consolidation_s
                    ):
                        self._idle_task = asyncio.create_task(self._consolidate_idle())
                    else:  # the next chunk's fold consolidates, in one pass with its prefill
                        self.idle_consolidations_skipped += 1
                now = time.perf_counter()
                self._boundary_at = now
                yield ChunkFinished(
                    finish_reason=completion_out.finish_reason,
                    prompt_tokens=prompt_tokens,
                    completion_tokens=completion if reply else 0,
                    ttft_ms=None
                    if first_token is None or not reply
                    else (first_token - started) * 1e3,
                    total_ms=(now - started) * 1e3,
                    report=report,
                )
                return

    async def restore(
        self,
        snapshot: SessionSnapshot,
        *,
        chunks: int,
        turn_open: bool,
        media: Mapping[int, tuple[str, Any]] | None = None,
        pad_ids: Mapping[str, int] | None = None,
        processor_kwargs: dict[str, Any] | None = None,
    ) -> int:
        """Rebuild this (new) session from another replica's snapshot: one chunk whose prompt
        is the held tokens, prefilled at 0..n-1 in a consolidation's pieces; the engine
        records them as the snapshot's history (`policy.RESTORE_KEY`). Afterwards the session
        is what the original was after a consolidation. Returns the tokens re-prefilled.

        A video session (`media`: each retained frame's kind and decoded data by segment
        index; `pad_ids`: the model's placeholder token per kind) is rebuilt as an mRoPE
        consolidation re-prefills it: remnants dropped, every retained frame passed again as
        `multi_modal_data` in prompt order. vLLM's processor expands each placeholder from a
        single pad token, so each frame's run of pads is collapsed to one here, and the
        re-expanded prompt must give back the snapshot's tokens exactly (checked after the
        rebuild: a rebuild that holds anything else is refused, never served)."""
        from vllm.inputs import TokensPrompt

        if self.chunks or not self.bounded:
            raise RuntimeError("restore() rebuilds a new bounded session only")
        prompt: dict[str, Any]
        if media is not None:
            snapshot = whole_chunks(snapshot)
            ids, mm = media_prompt(snapshot, media, pad_ids or {})
            prompt = dict(TokensPrompt(prompt_token_ids=ids))
            if mm:
                prompt["multi_modal_data"] = mm
                if processor_kwargs:
                    # The session's frame cap, told to the processor as the live chunks told
                    # it: the frames re-expand to the tokens the record holds.
                    prompt["mm_processor_kwargs"] = processor_kwargs
        else:
            prompt = dict(TokensPrompt(prompt_token_ids=list(snapshot.token_ids)))
        params = self.chunk_params(reply=False)
        history = {k: v for k, v in snapshot.to_dict().items() if k != "token_ids"}
        params.extra_args = {**(params.extra_args or {}), RESTORE_KEY: history}
        async for _ in self.run_chunk(prompt, params, reply=False):
            pass
        held = self.snapshot
        if held is not None and (
            held.token_ids != snapshot.token_ids or held.segments != snapshot.segments
        ):
            raise EngineError("the rebuilt session does not hold what its record holds")
        self.chunks = chunks
        self.turn_open = turn_open
        return len(snapshot.token_ids)

    @property
    def snapshot(self) -> SessionSnapshot | None:
        """The last chunk boundary's snapshot (sessions opened with `snapshots`)."""
        report = self.boundary_report
        return None if report is None else report.snapshot

    async def settle(self) -> None:
        """Wait for an idle consolidation in flight, if any (its failure is not raised here)."""
        task = self._idle_task
        if task is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.shield(task)

    async def _wait_idle_consolidation(self) -> None:
        """Wait for the control chunk in flight, if any (its failure is this chunk's). Shielded:
        a cancelled caller leaves it running, and the next chunk waits for it again."""
        task = self._idle_task
        if task is None:
            return
        try:
            await asyncio.shield(task)
        finally:
            if task.done():
                self._idle_task = None

    async def _consolidate_idle(self) -> None:
        """Send one control chunk (consolidate now) and read its outputs up to its boundary."""
        from vllm.engine.protocol import StreamingInput
        from vllm.inputs import TokensPrompt

        params = self._sampling_params.clone()
        params.max_tokens = 1
        params.min_tokens = 0
        params.logprobs = None
        params.structured_outputs = None
        params.extra_args = {**(params.extra_args or {}), CONTROL_KEY: CONSOLIDATE}
        # The token is never computed: the scheduler drops it at the fold.
        prompt = TokensPrompt(prompt_token_ids=[0])
        started = time.perf_counter()
        rendered = await render_prompt(self.engine, prompt)
        self._inputs.put_nowait(StreamingInput(prompt=rendered, sampling_params=params))
        assert self._outputs is not None
        while True:
            out = await self._next_output()
            report = SessionReport.from_wire(out.kv_transfer_params)
            completion_out = out.outputs[0] if out.outputs else None
            if out.finished:
                raise self._ended(report, completion_out)
            if completion_out is not None and completion_out.finish_reason is not None:
                if report is not None:
                    self.boundary_report = report
                self.idle_consolidations += 1
                self._last_consolidation_s = time.perf_counter() - started
                return

    async def _next_output(self) -> Any:
        """The session's next output; the protocol error if the stream ended or failed."""
        assert self._outputs is not None
        try:
            return await self._outputs.__anext__()
        except StopAsyncIteration:
            self.finished = True
            raise EngineError("the engine ended this session") from None
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.finished = True
            raise _engine_failure(exc) from None

    def _ended(self, report: SessionReport | None, completion_out: Any) -> RealtimeError:
        """The session's terminal output (finished=True) arrived: record it, map its error."""
        self.finished = True
        self.end_report = report
        finish = getattr(completion_out, "finish_reason", None)
        return _engine_failure(report=report, finish_reason=finish)

    @property
    def last_consolidation_s(self) -> float | None:
        """How long the last idle consolidation took (control chunk sent → its boundary)."""
        return self._last_consolidation_s

    @property
    def consolidating(self) -> bool:
        """A control chunk (idle consolidation) is in flight."""
        return self._idle_task is not None and not self._idle_task.done()

    @property
    def last_report(self) -> SessionReport | None:
        """EngineCore's latest word on the session: its end if it ended it, else the last
        boundary's (None before the first boundary)."""
        return self.end_report or self.boundary_report

    @property
    def tokens_in_context(self) -> int:
        """Tokens the request held at its last chunk boundary, as EngineCore reported them
        (prompts and replies, the last sampled token excluded; 0 before the first boundary)."""
        return 0 if self.boundary_report is None else self.boundary_report.tokens_in_context

    async def abort(self) -> None:
        """Abort the request and free its KV blocks. The caller cancels any task that is inside
        `run_chunk` first. The input stream is NOT ended here: ending it makes vLLM send its
        final "finished" request, which would race with the abort."""
        self.finished = True
        task, self._idle_task = self._idle_task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        elif task is not None and not task.cancelled():
            task.exception()  # retrieved: a failed consolidation is not logged as unhandled
        if self._outputs is not None:
            outputs, self._outputs = self._outputs, None
            # GeneratorExit inside generate() makes vLLM abort the request itself.
            with contextlib.suppress(Exception):
                await outputs.aclose()  # type: ignore[attr-defined]
        with contextlib.suppress(Exception):
            await self.engine.abort(self.request_id)


def storable_frames(engine: Any) -> dict[str, int] | None:
    """The served model's placeholder token per frame kind, if its video sessions can be
    stored (rebuilt elsewhere from their frames; the family table's `stores_frames` column,
    retention/vllm_adapter/model_families.py); else None."""
    from retention.vllm_adapter.model_families import stores_frames as family_stores_frames

    config = getattr(engine.model_config, "hf_config", None)
    if not family_stores_frames(getattr(config, "architectures", None)):
        return None
    image, video = getattr(config, "image_token_id", None), getattr(config, "video_token_id", None)
    if not isinstance(image, int) or not isinstance(video, int):
        return None
    return {"image": image, "video": video}
