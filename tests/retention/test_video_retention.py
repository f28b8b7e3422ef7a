"""Bounded video sessions on the tiny random Qwen2-VL (mRoPE): eviction, consolidation, endurance.

Oracles, in float32 against transformers' Qwen2VLForConditionalGeneration (eager attention) on
the same weights; random weights, so log-probabilities are compared, never text:

* In place (no consolidation yet): a dense forward over EVERY token the session ever held, with
  the 3-D position ids transformers computes for that whole sequence (``get_rope_index``, all
  images included), under an attention mask that lets each token see exactly what the cache
  held when it was computed (see test_text_retention.py for why a survivors-only pass is a
  different function). This pins down the worker's maintained mRoPE tensor: survivors keep
  their original 3-D positions, a new chunk continues at (max held position + 1), and decode
  tokens after a compaction continue from there (``mrope_position_delta``).
* After a consolidation the oracle restarts from the survivors alone (whole chunks; remnants
  are dropped for mRoPE models), re-prefilled at fresh positions, and goes on as above.

Images and 4-frame clips (``<|video_pad|>``) are both exercised.

TOLERANCE (1e-4): vLLM's CPU kernels and transformers' eager attention differ in summation order
only; the measured worst difference is ~1e-6 (the tests print theirs). The tiny random model is
weakly position-sensitive: putting a chunk 16 positions too low (what a renumbering of the
survivors does) moves log-probabilities by ~4e-3, so the tolerance is kept 40x below that and
the eviction test asserts the gap.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from realtime.models import model_dir
from retention.vllm_adapter.introspect import kv_stats, retention_state, worker_stats

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4
TOP_K = 5
SYSTEM = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"


def frame_prompt(i: int, kind: str = "image") -> str:
    pad = "<|image_pad|>" if kind == "image" else "<|video_pad|>"
    return (
        f"<|im_end|>\n<|im_start|>user\n<|vision_start|>{pad}<|vision_end|>"
        f"frame {i}<|im_end|>\n<|im_start|>assistant\n"
    )


def frame_image(seed: int) -> Any:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (112, 112, 3), dtype=np.uint8))


def frame_clip(seed: int, frames: int = 4) -> Any:
    """A short clip as the server decodes one: uint8 (T, H, W, 3), T even."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(0, 255, (frames, 112, 112, 3), dtype=np.uint8)


@pytest.fixture(scope="module")
def hf_vlm() -> Any:
    import torch
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(
        str(model_dir("tiny-qwen2-vl")), dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    return model


@pytest.fixture(scope="module")
def processor() -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(model_dir("tiny-qwen2-vl")))


@dataclass
class Chunk:
    """What the processor makes of one chunk (the engine runs the same processor)."""

    token_ids: list[int]
    kind: str = "text"  # or "image" / "video"
    pixel_values: Any = None
    grid_thw: Any = None
    media: Any = None  # what the engine gets in multi_modal_data

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
    out = processor(text=[prompt], videos=[media], return_tensors="pt")
    return Chunk(
        out["input_ids"][0].tolist(),
        kind,
        out["pixel_values_videos"],
        out["video_grid_thw"],
        media,
    )


def make_chunk(processor: Any, i: int, seed: int, video_every: int = 0) -> tuple[str, Chunk]:
    """Chunk 0 is the system prompt; then a frame per chunk (every `video_every`-th a clip)."""
    if i == 0:
        return SYSTEM, process(processor, SYSTEM)
    kind = "video" if video_every and i % video_every == 0 else "image"
    media = frame_clip(seed + i) if kind == "video" else frame_image(seed + i)
    prompt = frame_prompt(i, kind)
    return prompt, process(processor, prompt, kind, media)


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
        """Log-probabilities of the next token after each of `rows` (dense masked forward).

        Negative control: `shift` moves the positions of tokens `shift_from..` down by that much
        (as a renumbering of the survivors would place a new chunk)."""
        import torch

        n = len(self.tokens)
        ids = torch.tensor([self.tokens])
        order = sorted(self.images, key=lambda i: self.spans[i][0])
        media: dict[str, Any] = {}
        for kind, pixel_key, grid_key in (
            ("image", "pixel_values", "image_grid_thw"),
            ("video", "pixel_values_videos", "video_grid_thw"),
        ):
            chunks = [self.images[i] for i in order if self.images[i].kind == kind]
            if chunks:
                media[pixel_key] = torch.cat([c.pixel_values for c in chunks])
                media[grid_key] = torch.cat([c.grid_thw for c in chunks])
        position_ids = self._positions(model, ids, media)
        if shift:
            position_ids[:, :, shift_from:] -= shift
        mask = torch.full((1, 1, n, n), float("-inf"))
        for j, seen in enumerate(self.visible):
            mask[0, 0, j, seen] = 0.0
        with torch.no_grad():
            out = model(input_ids=ids, position_ids=position_ids, attention_mask=mask, **media)
        return torch.log_softmax(out.logits[0, rows].float(), dim=-1)

    @staticmethod
    def _positions(model: Any, ids: Any, media: dict[str, Any]) -> Any:
        """transformers' own 3-D positions of the whole sequence."""
        import torch

        if not media:
            return torch.arange(ids.shape[1]).view(1, 1, -1).expand(3, 1, -1).clone()
        types = (ids == model.config.image_token_id).int() + 2 * (
            ids == model.config.video_token_id
        ).int()
        positions, _ = model.model.get_rope_index(
            ids,
            mm_token_type_ids=types,
            image_grid_thw=media.get("image_grid_thw"),
            video_grid_thw=media.get("video_grid_thw"),
        )
        return positions


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
) -> dict[str, Any]:
    """Run a session frame by frame; check every sampled token against the dense oracle.

    `reset_encoder_cache`: empty vLLM's encoder cache before every chunk, so that a
    consolidation's re-prefill must run the vision encoder again on the surviving frames."""
    session = VideoSession(engine, budget)
    oracle = DenseOracle()
    report: dict[str, Any] = {
        "max_diff": 0.0,
        "evicted_checks": 0,
        "consolidated_checks": 0,
        "renumber_gap": 0.0,
        # per consolidation: (encoder inputs run for the re-prefill, frames re-prefilled)
        "reprefill_encoder_runs": [],
    }
    consolidations = 0
    encoder_runs = 0
    try:
        pending: tuple[int, Chunk, list[int]] | None = None
        for i in range(num_frames + 1):
            prompt, chunk = make_chunk(processor, i, seed, video_every)
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
            held = state["history_positions"]
            assert [oracle.tokens[p] for p in held] == state["token_ids"]
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


async def test_eviction_matches_masked_dense_oracle_with_3d_positions(
    vlm_engine: Any, hf_vlm: Any, processor: Any
) -> None:
    budget = {"sink_chunks": 1, "window_chunks": 3, "low_watermark_ratio": 0.34}
    report = await drive_and_check(
        vlm_engine, hf_vlm, processor, budget, num_frames=10, video_every=3
    )
    state = report["state"]
    print(
        "eviction oracle: max |Δ logprob| =",
        report["max_diff"],
        "renumbered gap =",
        report["renumber_gap"],
    )
    assert report["evicted_checks"] >= 4
    assert state["evictions"] >= 2 and state["consolidations"] == 0
    assert state["encoder_entries_released"] >= 4
    # Stock vLLM's renumbering would be visibly wrong: the oracle tells them apart.
    assert report["renumber_gap"] > 10 * TOLERANCE
    stats = await wait_all_blocks_free(vlm_engine)
    assert stats["num_free_blocks"] == stats["num_usable_blocks"]


async def test_consolidation_matches_fresh_prefill_of_survivors(
    vlm_engine: Any, hf_vlm: Any, processor: Any
) -> None:
    budget = {
        "sink_chunks": 1,
        "window_chunks": 2,
        "low_watermark_ratio": 0.5,
        "max_position": 200,
    }
    report = await drive_and_check(
        vlm_engine, hf_vlm, processor, budget, num_frames=14, seed=100, reset_encoder_cache=True
    )
    print(
        "consolidation oracle: max |Δ logprob| =",
        report["max_diff"],
        "encoder runs per re-prefill (runs, frames):",
        report["reprefill_encoder_runs"],
    )
    assert report["consolidated_checks"] >= 2
    # The encoder cache was emptied: every surviving frame was encoded again from the pixel
    # data the scheduler keeps for held frames (and the oracle above agrees).
    assert all(runs == frames for runs, frames in report["reprefill_encoder_runs"])
    assert report["state"]["position_cursor"] <= 200


async def test_concurrent_sessions_each_evict_only_their_own_blocks(
    vlm_engine: Any, hf_vlm: Any, processor: Any
) -> None:
    narrow = {"sink_chunks": 1, "window_chunks": 2, "low_watermark_ratio": 0.5}
    wide = {"sink_chunks": 1, "window_chunks": 4, "low_watermark_ratio": 0.5, "max_position": 300}
    reports = await asyncio.gather(
        drive_and_check(vlm_engine, hf_vlm, processor, narrow, num_frames=9, seed=200),
        drive_and_check(vlm_engine, hf_vlm, processor, wide, num_frames=9, seed=300, video_every=2),
    )
    print(
        "concurrent oracle: max |Δ logprob| =",
        [r["max_diff"] for r in reports],
        "encoder runs per re-prefill (runs, frames):",
        reports[1]["reprefill_encoder_runs"],
    )
    # With the encoder cache intact a re-prefill reuses the held frames' encoder outputs.
    assert reports[1]["consolidated_checks"] >= 1
    assert all(runs == 1 for runs, _ in reports[1]["reprefill_encoder_runs"])
    assert all(r["state"]["evictions"] >= 2 for r in reports)
    stats = await wait_all_blocks_free(vlm_engine)
    assert stats["num_free_blocks"] == stats["num_usable_blocks"]


def _slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )


ENDURANCE_FRAMES = 1000


async def test_endurance_1000_frames_bounded_and_no_leak(vlm_engine: Any) -> None:
    stats0 = await wait_all_blocks_free(vlm_engine)
    usable = stats0["num_usable_blocks"]
    assert stats0["num_free_blocks"] == usable
    budget = {
        "sink_chunks": 1,
        "window_chunks": 3,
        "low_watermark_ratio": 0.34,
        "max_position": 2000,
    }
    session = VideoSession(vlm_engine, budget, max_tokens=1)
    samples: list[dict[str, Any]] = []
    frame_ms: dict[int, float] = {}
    try:
        await session.send(SYSTEM)
        for i in range(1, ENDURANCE_FRAMES + 1):
            media = {"image": frame_image(10_000 + i)}
            started = time.perf_counter()
            await session.send(frame_prompt(i), media)
            frame_ms[i] = (time.perf_counter() - started) * 1e3
            if i % 50 == 0 or i in (10, ENDURANCE_FRAMES):
                kv = await kv_stats(vlm_engine)
                (worker,) = await worker_stats(vlm_engine)
                state = await retention_state(vlm_engine, session.request_id)
                assert state is not None
                samples.append(
                    {
                        "frame": i,
                        "blocks": kv["blocks_by_request"].get(session.request_id, 0),
                        "encoder_entries": kv["encoder_cache_entries"],
                        "worker_encoder_entries": worker["encoder_cache_entries"],
                        "mrope_columns": worker["mrope_columns_by_request"].get(session.request_id),
                        "tokens_held": state["tokens_held"],
                        "mm_items_held": state["mm_items_held"],
                        "core_rss": kv["rss_bytes"],
                        "worker_rss": worker["rss_bytes"],
                        "worker_shmem": worker["rss_split_bytes"].get("shmem"),
                    }
                )
        state = await retention_state(vlm_engine, session.request_id)
        assert state is not None
    finally:
        await session.close()
    for s in samples:
        print("endurance", s)

    def median(frames: range) -> float:
        values = sorted(frame_ms[i] for i in frames)
        return values[len(values) // 2]

    early, late = median(range(1, 21)), median(range(ENDURANCE_FRAMES - 19, ENDURANCE_FRAMES + 1))
    print(
        f"endurance: per-frame median {early:.1f} ms (frames 1-20), {late:.1f} ms (last 20); "
        f"frame 10 {frame_ms[10]:.0f} ms, frame {ENDURANCE_FRAMES} "
        f"{frame_ms[ENDURANCE_FRAMES]:.0f} ms; blocks {samples[0]['blocks']} at frame 10, "
        f"{samples[-1]['blocks']} at frame {ENDURANCE_FRAMES}"
    )
    # Cost per frame does not grow with the session's age (generous: CI machines are noisy).
    assert late < 5 * early + 100, (early, late)
    assert state["evictions"] > 100 and state["consolidations"] >= 5
    assert state["position_cursor"] <= 2000
    # Pixel data is kept only for the items held (what a re-prefill may need).
    assert state["mm_items_with_data"] <= state["mm_items_held"] <= 6
    # Window of 3 frames (~30 tokens each) + sink + remnants: a handful of 32-token blocks.
    assert max(s["blocks"] for s in samples) <= 8
    # Items held: the window (3), the chunk just folded in, and remnants that kept a whole image.
    assert max(s["mm_items_held"] for s in samples) <= 6
    # Encoder-cache entries: this session's held items on top of what earlier sessions left
    # (stock vLLM frees a finished request's entries lazily, under pressure).
    base = stats0["encoder_cache_entries"]
    assert all(s["encoder_entries"] <= base + s["mm_items_held"] for s in samples), base
    assert all(s["worker_encoder_entries"] <= base + s["mm_items_held"] for s in samples), base
    assert max(s["mrope_columns"] or 0 for s in samples) <= 8 * 32
    # RSS after warm-up (the first 200 frames): slope in bytes per frame.
    warm = [s for s in samples if s["frame"] >= 200]
    frames = [float(s["frame"]) for s in warm]
    for key in ("core_rss", "worker_rss"):
        slope = _slope(frames, [float(s[key]) for s in warm])
        print(f"endurance: {key} slope {slope:.0f} B/frame")
        assert slope < 4096, (key, slope)
    # vLLM's step rings were made resident at start-up (shm_prefault.py): ten 1 MiB chunks of
    # the step ring and 1 MiB of each answer chunk, and not a page more as frames of every size
    # (re-prefills included) pass through them.
    shmem = {s["worker_shmem"] for s in samples}
    if shmem != {None}:
        assert len(shmem) == 1 and min(shmem) >= 20 << 20, sorted(shmem)
    stats = await wait_all_blocks_free(vlm_engine)
    assert stats["num_free_blocks"] == usable
