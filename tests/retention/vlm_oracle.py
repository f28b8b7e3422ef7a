"""The masked dense oracle for bounded video sessions on mRoPE VLMs (Qwen2-VL, Qwen2.5-VL,
Qwen3-VL), shared by the video retention, preemption and family tests.

Oracles, in float32 against transformers' own model class (eager attention) on the same
weights; random weights, so log-probabilities are compared, never text:

* In place (no consolidation yet): a dense forward over EVERY token the session ever held, with
  the 3-D position ids transformers computes for that whole sequence (the model's own
  ``get_rope_index``, every held item included), under an attention mask that lets each token
  see exactly what the cache held when it was computed (see test_text_retention.py for why a
  survivors-only pass is a different function). This pins down the worker's maintained mRoPE
  tensor: survivors keep their original 3-D positions, a new chunk continues at (max held
  position + 1), and decode tokens after a compaction continue from there
  (``mrope_position_delta``).
* After a consolidation the oracle restarts from the survivors alone (whole chunks; remnants
  are dropped for mRoPE models), re-prefilled at fresh positions, and goes on as above.

The forward is built from the parts transformers' own forward uses, item by item: each held
image or clip is encoded alone (``get_image_features`` / ``get_video_features``) and its
features placed at its placeholders; placeholders of no held item (orphans of a preemption
remnant) stay text. Qwen3-VL's deepstack features are added to the first decoder layers at the
same visual positions (``visual_pos_masks``), as its ``Qwen3VLModel.forward`` does; Qwen2.5-VL's
clips pass their ``second_per_grid_ts`` to ``get_rope_index``.

TOLERANCE (1e-4): vLLM's CPU kernels and transformers' eager attention differ in summation order
only; the measured worst difference is ~1e-6 (the tests print theirs). The tiny random models
are weakly position-sensitive: putting a chunk 16 positions too low (what a renumbering of the
survivors does) moves log-probabilities by ~1e-3 to 1e-1, so the eviction tests assert that gap.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from retention.vllm_adapter.introspect import kv_stats, retention_state, worker_stats

TOLERANCE = 1e-4
TOP_K = 5
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"


class TokenLog:
    """The engine, with every output token id and its log-probability kept. Every chunk asks
    for the sampled token's log-probability (vLLM's front end sets up its log-prob processor
    once per streaming request, so all chunks of one session must agree)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.ids: list[int] = []
        self.logprobs: list[float] = []

    def __getattr__(self, name: str) -> Any:
        # The renderer and model config the session renders its chunks with.
        return getattr(self.engine, name)

    def generate(self, inputs: Any, params: Any, **kwargs: Any) -> AsyncIterator[Any]:
        async def with_logprobs() -> AsyncIterator[Any]:
            async for chunk in inputs:
                if chunk.sampling_params is not None:
                    chunk.sampling_params.logprobs = 0
                yield chunk

        params.logprobs = 0
        inner = self.engine.generate(with_logprobs(), params, **kwargs)

        async def gen() -> AsyncIterator[Any]:
            try:
                async for out in inner:
                    if out.outputs:
                        c = out.outputs[0]
                        self.ids.extend(c.token_ids)
                        for tok, entry in zip(c.token_ids, c.logprobs or [], strict=False):
                            self.logprobs.append(entry[tok].logprob)
                    yield out
            finally:
                await inner.aclose()

        return gen()

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)


def frame_prompt(i: int, kind: str = "image") -> str:
    pad = "<|image_pad|>" if kind == "image" else "<|video_pad|>"
    return (
        f"<|im_end|>\n<|im_start|>user\n<|vision_start|>{pad}<|vision_end|>"
        f"frame {i}<|im_end|>\n<|im_start|>assistant\n"
    )


def frame_image(seed: int, size: int = 112) -> Any:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))


def frame_clip(seed: int, frames: int = 4, size: int = 112) -> Any:
    """A short clip as the server decodes one: uint8 (T, H, W, 3), T even."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(0, 255, (frames, size, size, 3), dtype=np.uint8)


def clip_with_fps(clip: Any, fps: float) -> tuple[Any, dict[str, Any]]:
    """A clip with the metadata Qwen2.5-VL and Qwen3-VL require (vLLM refuses a bare array):
    its frames as they are (no resampling) at `fps`, which sets Qwen2.5-VL's temporal scaling
    (second_per_grid_ts = 2 / fps) and Qwen3-VL's timestamps."""
    frames = int(clip.shape[0])
    return clip, {
        "fps": fps,
        "duration": frames / fps,
        "total_num_frames": frames,
        "frames_indices": list(range(frames)),
        "video_backend": "opencv",
        "do_sample_frames": False,
    }


@dataclass
class Chunk:
    """What the processor makes of one chunk (the engine runs the same processor)."""

    token_ids: list[int]
    kind: str = "text"  # or "image" / "video"
    pixel_values: Any = None
    grid_thw: Any = None
    media: Any = None  # what the engine gets in multi_modal_data
    second_per_grid_ts: Any = None  # Qwen2.5-VL clips: the temporal scaling of its positions

    @property
    def multi_modal_data(self) -> dict[str, Any] | None:
        return None if self.media is None else {self.kind: self.media}


def process(processor: Any, prompt: str, kind: str = "text", media: Any = None) -> Chunk:
    if kind == "text":
        ids = processor.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        return Chunk(list(ids))
    if kind == "image":
        out = processor(text=[prompt], images=[media], return_tensors="pt")
        return Chunk(
            out["input_ids"][0].tolist(), kind, out["pixel_values"], out["image_grid_thw"], media
        )
    extra: dict[str, Any] = {}
    frames = media
    if isinstance(media, tuple):
        frames, metadata = media
        extra["video_metadata"] = [{k: v for k, v in metadata.items() if k != "do_sample_frames"}]
        extra["do_sample_frames"] = False
    out = processor(text=[prompt], videos=[frames], return_tensors="pt", **extra)
    return Chunk(
        out["input_ids"][0].tolist(),
        kind,
        out["pixel_values_videos"],
        out["video_grid_thw"],
        media,
        out.get("second_per_grid_ts"),
    )


@dataclass(frozen=True)
class Media:
    """How a family's test frames are made: image side, clip side and frames, clip fps (None:
    a bare array, as Qwen2-VL takes it)."""

    image_size: int = 112
    clip_size: int = 112
    clip_frames: int = 4
    clip_fps: float | None = None


def make_chunk(
    processor: Any, i: int, seed: int, video_every: int = 0, media: Media = Media()
) -> tuple[str, Chunk]:
    """Chunk 0 is the system prompt; then a frame per chunk (every `video_every`-th a clip)."""
    if i == 0:
        return SYSTEM, process(processor, SYSTEM)
    kind = "video" if video_every and i % video_every == 0 else "image"
    if kind == "video":
        clip = frame_clip(seed + i, media.clip_frames, media.clip_size)
        data = clip if media.clip_fps is None else clip_with_fps(clip, media.clip_fps)
    else:
        data = frame_image(seed + i, media.image_size)
    prompt = frame_prompt(i, kind)
    return prompt, process(processor, prompt, kind, data)


class VideoSession:
    """A retention session driven chunk by chunk (one chunk in flight, as the server does)."""

    def __init__(self, engine: Any, budget: dict[str, Any], max_tokens: int = 2) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.engine = engine
        self.request_id = f"video-{uuid.uuid4().hex[:12]}"
        self.inputs: asyncio.Queue[Any] = asyncio.Queue()
        self.params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            ignore_eos=True,
            logprobs=TOP_K,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"streaming_retention": budget},
        )
        self.outputs: Any = None

    async def _stream(self) -> AsyncIterator[Any]:
        while True:
            item = await self.inputs.get()
            if item is None:
                return
            yield item

    async def send(
        self, prompt: str, multi_modal_data: dict[str, Any] | None = None
    ) -> tuple[list[int], list[dict[int, float]]]:
        from vllm.engine.protocol import StreamingInput

        p: dict[str, Any] = {"prompt": prompt}
        if multi_modal_data is not None:
            p["multi_modal_data"] = multi_modal_data
        self.inputs.put_nowait(StreamingInput(prompt=p))
        if self.outputs is None:
            self.outputs = self.engine.generate(
                self._stream(), self.params, request_id=self.request_id
            )
        tokens: list[int] = []
        logprobs: list[dict[int, float]] = []
        while True:
            out = await self.outputs.__anext__()
            assert not out.finished, "a retention session must not end on its own"
            completion = out.outputs[0]
            tokens.extend(completion.token_ids)
            for entry in completion.logprobs or []:
                logprobs.append({tok: lp.logprob for tok, lp in entry.items()})
            if completion.finish_reason is not None:
                return tokens, logprobs

    async def close(self) -> None:
        if self.outputs is not None:
            await self.outputs.aclose()
        await self.engine.abort(self.request_id)


def media_token_ids(model: Any) -> tuple[int, int]:
    return int(model.config.image_token_id), int(model.config.video_token_id)


def continue_after_items(positions: Any, types: Any) -> Any:
    """Text after an item continues at the largest position so far + 1: the rule of Qwen's
    reference ``get_rope_index`` and of vLLM's ``get_mrope_input_positions``.

    transformers 5.19's Qwen2.5-VL ``get_rope_index`` advances past an item by max(h, w) only,
    ignoring the clip's temporal extent (scaled by ``second_per_grid_ts × tokens_per_second``),
    so the text after a scaled clip overlaps its positions there; a plain vLLM request (no
    retention) differs from it by ~1e-4..1e-3 in log-probs. Everywhere else (images, clips
    whose temporal extent is below max(h, w), Qwen2-VL, Qwen3-VL's one-patch frames) this
    changes nothing. The item's own positions are transformers'."""
    out = positions.clone()
    shift = 0
    top = -1
    for j in range(positions.shape[-1]):
        if j and int(types[0, j]) == 0 and int(types[0, j - 1]) != 0:
            shift = top + 1 - int(positions[0, 0, j])
        out[:, :, j] = positions[:, :, j] + shift
        top = max(top, int(out[:, :, j].max()))
    return out


def dense_logprobs(
    model: Any,
    tokens: list[int],
    items: list[tuple[int, Chunk]],
    visible: list[list[int]],
    rows: list[int],
    shift_from: int = 0,
    shift: int = 0,
) -> Any:
    """Log-probs after each of `rows`, for `tokens` where each of `items` (start offset, chunk)
    is a held image or clip at its placeholders; any other placeholder token is text. Token j
    sees `visible[j]`.

    Negative control: `shift` moves the positions of tokens `shift_from..` down by that much
    (as a renumbering of the survivors would place a new chunk)."""
    import torch

    image_id, video_id = media_token_ids(model)
    n = len(tokens)
    ids = torch.tensor([tokens])
    types = torch.zeros((1, n), dtype=torch.int)
    embeds = model.get_input_embeddings()(ids).clone()
    grids: dict[str, list[Any]] = {"image": [], "video": []}
    seconds: list[Any] = []
    deepstack: list[Any] = []  # per decoder layer: (n, hidden) features at visual positions
    for start, chunk in sorted(items, key=lambda item: item[0]):
        pad = image_id if chunk.kind == "image" else video_id
        span = [start + k for k, t in enumerate(chunk.token_ids) if t == pad]
        assert all(tokens[p] == pad for p in span)
        with torch.no_grad():
            if chunk.kind == "image":
                out = model.model.get_image_features(chunk.pixel_values, chunk.grid_thw)
            else:
                out = model.model.get_video_features(chunk.pixel_values, chunk.grid_thw)
        features = torch.cat(list(out.pooler_output))
        assert features.shape[0] == len(span)
        embeds[0, span] = features.to(embeds.dtype)
        types[0, span] = 1 if chunk.kind == "image" else 2
        grids[chunk.kind].append(chunk.grid_thw)
        if chunk.kind == "video" and chunk.second_per_grid_ts is not None:
            seconds.append(torch.as_tensor(chunk.second_per_grid_ts).reshape(-1))
        for layer, feature in enumerate(getattr(out, "deepstack_features", None) or ()):
            if len(deepstack) <= layer:
                deepstack.append(embeds.new_zeros((n, embeds.shape[-1])))
            deepstack[layer][span] = torch.cat(list(feature)).to(embeds.dtype)
    rope_args: dict[str, Any] = {
        "image_grid_thw": torch.cat(grids["image"]) if grids["image"] else None,
        "video_grid_thw": torch.cat(grids["video"]) if grids["video"] else None,
    }
    if seconds:
        rope_args["second_per_grid_ts"] = torch.cat(seconds)
    if grids["image"] or grids["video"]:
        positions, _ = model.model.get_rope_index(ids, mm_token_type_ids=types, **rope_args)
        positions = continue_after_items(positions, types)
    else:
        positions = torch.arange(n).view(1, 1, -1).expand(3, 1, -1).clone()
    if shift:
        positions[:, :, shift_from:] -= shift
    mask = torch.full((1, 1, n, n), float("-inf"))
    for j, seen in enumerate(visible):
        mask[0, 0, j, seen] = 0.0
    with torch.no_grad():
        if deepstack:
            visual = types[0] > 0
            hidden = model.model.language_model(
                inputs_embeds=embeds,
                position_ids=positions,
                attention_mask=mask,
                visual_pos_masks=visual[None],
                deepstack_visual_embeds=[layer[visual] for layer in deepstack],
            ).last_hidden_state
            logits = model.lm_head(hidden)
        else:
            logits = model(inputs_embeds=embeds, position_ids=positions, attention_mask=mask).logits
    return torch.log_softmax(logits[0, rows].float(), dim=-1)


@dataclass
class DenseOracle:
    """Every token computed since the last consolidation, with what each one saw."""

    tokens: list[int] = field(default_factory=list)
    visible: list[list[int]] = field(default_factory=list)
    # chunk index -> (start, end) in `tokens`, and its image or clip if any
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)
    images: dict[int, Chunk] = field(default_factory=dict)

    def add(self, index: int, held: list[int], chunk: Chunk, kept_reply: list[int]) -> None:
        start = len(self.tokens)
        for tok in [*chunk.token_ids, *kept_reply]:
            self.visible.append([*held, *range(start, len(self.tokens) + 1)])
            self.tokens.append(tok)
        self.spans[index] = (start, len(self.tokens))
        if chunk.pixel_values is not None:
            self.images[index] = chunk

    def restart(self, survivors: list[int]) -> DenseOracle:
        """After a consolidation: the surviving whole chunks, re-prefilled causally."""
        fresh = DenseOracle()
        for index in survivors:
            a, b = self.spans[index]
            start = len(fresh.tokens)
            for tok in self.tokens[a:b]:
                fresh.visible.append(list(range(len(fresh.tokens) + 1)))
                fresh.tokens.append(tok)
            fresh.spans[index] = (start, len(fresh.tokens))
            if index in self.images:
                fresh.images[index] = self.images[index]
        return fresh

    def logprobs(self, model: Any, rows: list[int], shift_from: int = 0, shift: int = 0) -> Any:
        """Log-probabilities of the next token after each of `rows` (dense masked forward)."""
        items = [(self.spans[i][0], chunk) for i, chunk in self.images.items()]
        return dense_logprobs(model, self.tokens, items, self.visible, rows, shift_from, shift)


def compare(got: dict[int, float], want: Any, where: Any) -> float:
    worst = 0.0
    for tok, lp in got.items():
        diff = abs(lp - float(want[tok]))
        worst = max(worst, diff)
        assert diff < TOLERANCE, (where, tok, lp, float(want[tok]))
    assert max(got, key=got.__getitem__) == int(want.argmax()), where
    return worst


async def drive_and_check(
    engine: Any,
    hf_vlm: Any,
    processor: Any,
    budget: dict[str, Any],
    num_frames: int,
    seed: int = 0,
    reset_encoder_cache: bool = False,
    video_every: int = 0,
    media: Media = Media(),
    track_positions: bool = False,
) -> dict[str, Any]:
    """Run a session frame by frame; check every sampled token against the dense oracle.

    `track_positions`: after every chunk, record the worker's mRoPE tensor (its columns and
    its largest position + 1, decode included) beside the scheduler's token cursor.

    `reset_encoder_cache`: empty vLLM's encoder cache before every chunk, so that a
    consolidation's re-prefill must run the vision encoder again on the surviving frames.
    The report counts the checks made right after an eviction of an image chunk and of a clip
    chunk (`evicted_kinds`), after a consolidation, and the negative control's gap."""
    session = VideoSession(engine, budget)
    oracle = DenseOracle()
    report: dict[str, Any] = {
        "max_diff": 0.0,
        "evicted_checks": 0,
        "evicted_kinds": set(),
        "consolidated_checks": 0,
        "renumber_gap": 0.0,
        # per consolidation: (encoder inputs run for the re-prefill, frames re-prefilled)
        "reprefill_encoder_runs": [],
        "positions": [],
    }
    kinds: dict[int, str] = {}
    consolidations = 0
    encoder_runs = 0
    evicted_chunks = 0
    try:
        pending: tuple[int, list[int], Chunk, list[int]] | None = None
        for i in range(num_frames + 1):
            prompt, chunk = make_chunk(processor, i, seed, video_every, media)
            kinds[i] = chunk.kind
            if reset_encoder_cache:
                await engine.reset_encoder_cache()
            reply, logprobs = await session.send(prompt, chunk.multi_modal_data)
            state = await retention_state(engine, session.request_id)
            assert state is not None
            if pending is not None:  # the previous chunk's kept reply is known now
                oracle.add(*pending)
            if state["consolidations"] > consolidations:
                consolidations = state["consolidations"]
                survivors = [seg[0] for seg in state["segment_chunks"]]
                assert not any(seg[4] for seg in state["segment_chunks"]), "remnants dropped"
                oracle = oracle.restart(survivors)
                assert state["history_positions"] == list(range(len(oracle.tokens)))
                report["consolidated_checks"] += 1
                report["reprefill_encoder_runs"].append(
                    (state["encoder_inputs_scheduled"] - encoder_runs, len(oracle.images) + 1)
                )
            encoder_runs = state["encoder_inputs_scheduled"]
            if track_positions:
                (worker,) = await worker_stats(engine)
                report["positions"].append(
                    {
                        "chunk": i,
                        "columns": worker["mrope_columns_by_request"][session.request_id],
                        "top": worker["mrope_top_by_request"][session.request_id],
                        "cursor": state["position_cursor"],
                        "consolidations": state["consolidations"],
                    }
                )
            held = state["history_positions"]
            assert [oracle.tokens[p] for p in held] == state["token_ids"]
            # Chunks wholly evicted at this fold (by kind): the oracle below checks the state
            # right after their eviction.
            held_chunks = {seg[0] for seg in state["segment_chunks"]}
            gone = [j for j in oracle.spans if j not in held_chunks]
            if not consolidations and len(gone) > evicted_chunks:
                report["evicted_kinds"].update(kinds[j] for j in gone[evicted_chunks:])
                evicted_chunks = len(gone)
            # vLLM drops the last sampled token of a chunk; the others stay in context.
            kept = reply[:-1]
            probe = DenseOracle(
                list(oracle.tokens), [list(v) for v in oracle.visible], dict(oracle.spans)
            )
            probe.images = dict(oracle.images)
            probe.add(i, held, chunk, kept)
            end = len(probe.tokens)
            rows = [end - len(kept) - 1 + k for k in range(len(logprobs))]
            want = probe.logprobs(hf_vlm, rows)
            for k, got in enumerate(logprobs):
                report["max_diff"] = max(report["max_diff"], compare(got, want[k], (i, k)))
            if state["tokens_evicted"] and not consolidations and chunk.media is not None:
                report["evicted_checks"] += 1
                # Negative control: the chunk 16 positions too low, as a renumbering of the
                # survivors (stock vLLM's recomputation over the compacted prompt) puts it.
                start = end - len(chunk.token_ids) - len(kept)
                wrong = probe.logprobs(hf_vlm, rows[:1], shift_from=start, shift=16)[0]
                gap = max(abs(lp - float(wrong[t])) for t, lp in logprobs[0].items())
                report["renumber_gap"] = max(report["renumber_gap"], gap)
            pending = (i, held, chunk, kept)
        report["state"] = state
    finally:
        await session.close()
    return report


async def wait_all_blocks_free(engine: Any) -> dict[str, Any]:
    for _ in range(100):
        stats = await kv_stats(engine)
        if stats["num_free_blocks"] == stats["num_usable_blocks"]:
            return stats
        await asyncio.sleep(0.05)
    return await kv_stats(engine)


# --------------------------------------------------------------------------- preemption


async def send_chunk(
    session: VideoSession,
    chunk_prompt: str,
    chunk: Chunk,
    *,
    max_tokens: int,
    preempt_after_first_token: bool = False,
) -> tuple[list[int], list[dict[int, float]]]:
    """One chunk with its own max_tokens; optionally preempt the session while it decodes."""
    from vllm.engine.protocol import StreamingInput

    params = session.params.clone()
    params.max_tokens = max_tokens
    p: dict[str, Any] = {"prompt": chunk_prompt}
    if chunk.multi_modal_data is not None:
        p["multi_modal_data"] = chunk.multi_modal_data
    session.inputs.put_nowait(StreamingInput(prompt=p, sampling_params=params))
    tokens: list[int] = []
    logprobs: list[dict[int, float]] = []
    preempted = False
    while True:
        out = await session.outputs.__anext__()
        assert not out.finished, "a retention session must not end on its own"
        completion = out.outputs[0]
        tokens.extend(completion.token_ids)
        for entry in completion.logprobs or []:
            logprobs.append({tok: lp.logprob for tok, lp in entry.items()})
        if completion.finish_reason is not None:
            return tokens, logprobs
        if preempt_after_first_token and tokens and not preempted:
            preempted = True
            assert await session.engine.reset_prefix_cache(reset_running_requests=True)


async def preempt_and_check(
    engine: Any,
    hf_vlm: Any,
    processor: Any,
    seed: int = 500,
    video_every: int = 3,
    media: Media = Media(),
) -> dict[str, Any]:
    """A bounded session that evicted (images and clips), preempted while its chunk decodes
    beside a plain request, then checked (test_video_preemption.py's module docstring):
    (a) the next chunk against the dense oracle of the resumed state, (b) prefix-cache probes
    equal to cold runs, (c) every block back at close. Returns the worst difference."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.retention.text_oracle import probe_matches_cold

    stats = await kv_stats(engine)
    assert stats["prefix_caching"], "these tests need prefix caching on"
    usable = stats["num_usable_blocks"]
    image_id, video_id = media_token_ids(hf_vlm)
    budget = {"sink_chunks": 1, "window_chunks": 2, "low_watermark_ratio": 0.5}
    session = VideoSession(engine, budget)
    chunks: list[Chunk] = []
    replies: list[list[int]] = []
    probes: list[tuple[list[int], dict[str, Any] | None]] = []
    try:
        for i in range(7):
            chunk_prompt, chunk = make_chunk(processor, i, seed, video_every, media)
            reply, _ = await session.send(chunk_prompt, chunk.multi_modal_data)
            chunks.append(chunk)
            replies.append(reply)
        before = await retention_state(engine, session.request_id)
        assert before is not None and before["tokens_evicted"] > 0, "evict before preempting"

        # The chunk preempted while it decodes, a plain request running beside it.
        async def competitor() -> None:
            params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
            words = processor.tokenizer("a plain request beside it " * 16)["input_ids"]
            prompt = TokensPrompt(prompt_token_ids=list(words)[:80])
            async for _ in engine.generate(prompt, params, request_id=f"c-{uuid.uuid4().hex[:6]}"):
                pass

        rival = asyncio.create_task(competitor())
        chunk_prompt, chunk = make_chunk(processor, 7, seed, media=media)
        reply, _ = await asyncio.wait_for(
            send_chunk(session, chunk_prompt, chunk, max_tokens=24, preempt_after_first_token=True),
            600,
        )
        await asyncio.wait_for(rival, 600)
        chunks.append(chunk)
        replies.append(reply)
        state = await retention_state(engine, session.request_id)
        assert state is not None
        assert state["preemptions"] >= 1, "the session was not preempted"
        held = state["token_ids"]
        assert state["history_positions"] == list(range(len(held)))

        # The resumed state: held tokens (whole survivors carry their item), then the
        # preempted chunk and its reply, all causal from 0.
        items: list[tuple[int, Chunk]] = []
        orphans = 0
        for index, _kind, start, end, remnant in state["segment_chunks"]:
            pads = sum(1 for t in held[start:end] if t in (image_id, video_id))
            if remnant:
                orphans += pads
            elif chunks[index].pixel_values is not None:
                items.append((start, chunks[index]))
        fresh = [*held, *chunk.token_ids, *reply[:-1]]
        items.append((len(held), chunk))
        # (a) The next chunk sees what the cache holds after its fold.
        chunk_prompt, nxt = make_chunk(processor, 8, seed, media=media)
        _, logprobs = await send_chunk(session, chunk_prompt, nxt, max_tokens=2)
        after = await retention_state(engine, session.request_id)
        assert after is not None
        cursor = after["position_cursor"]
        assert cursor == len(fresh), (cursor, len(fresh))
        visible = [list(range(j + 1)) for j in range(len(fresh))]
        visible += [
            after["history_positions"] + list(range(cursor, cursor + j + 1))
            for j in range(len(nxt.token_ids))
        ]
        want = dense_logprobs(
            hf_vlm,
            [*fresh, *nxt.token_ids],
            [*items, (cursor, nxt)],
            visible,
            [len(fresh) + len(nxt.token_ids) - 1],
        )
        worst = compare(logprobs[0], want[0], "after resume")
        assert worst < TOLERANCE

        # (b) Probes: the original prefix through the first frame, and the compacted content
        # up to its first held item (each a valid plain prompt: whole items, at most one).
        first_frame = [*chunks[0].token_ids, *replies[0][:-1], *chunks[1].token_ids]
        probes.append((first_frame, chunks[1].multi_modal_data))
        # The compacted content up to its first held item: sinks and remnants, orphaned
        # placeholders included (a plain prompt without media reads them as text, as the
        # resumed session does), so the block hashes match the resume's rebuilt chain.
        probes.append((fresh[: items[0][0]], None))
        cached = [await probe_matches_cold(engine, t, m) for t, m in probes]
        # The resume published its recomputed blocks (rebuilt chain): the second probe hits.
        assert cached[1] >= 32, cached
    finally:
        await session.close()
    for t, m in probes:
        await probe_matches_cold(engine, t, m)
    # (c) Every block is back.
    stats = await wait_all_blocks_free(engine)
    assert stats["num_free_blocks"] == usable
    return {"max_diff": worst, "orphans": orphans, "cached": cached}
