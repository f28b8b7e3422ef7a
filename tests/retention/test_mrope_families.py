"""Bounded video sessions on the mRoPE families beyond Qwen2-VL: Qwen3-VL (the design's
reference model: interleaved mRoPE, deepstack, video timestamps written as text) and Qwen2.5-VL
(a clip's temporal positions scaled by its duration), each a tiny random-weight model built
offline (realtime/models/tiny_qwen_vl.py) and served by the real vLLM CPU engine.

Per family (one engine per family for the whole module; first, before any bounded session,
plain streaming requests take none of our paths: no session report, no position function; then
the oracle of `vlm_oracle.py`:
transformers' own forward with the model's own ``get_rope_index``, over the session's actual
cache contents, log-probs within 1e-4 and argmax equal):

* eviction of image chunks and of clip chunks, in place (no consolidation);
* consolidation (the encoder cache emptied before every chunk, so the re-prefill encodes the
  surviving frames again);
* a forced preemption (the state test_video_preemption.py defines);
* 1,000 frames (tiny images, a clip every tenth): KV blocks, encoder-cache entries and mRoPE
  columns bounded, positions below max_position, nothing left at close.

Qwen2.5-VL also: clips whose temporal scaling makes positions outgrow the token count; the
session consolidates before max_position (the scheduler bounds the largest position, not the
token count: retention/vllm_adapter/mrope.py, "Position bound").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest

from realtime.models import model_dir
from retention.vllm_adapter.introspect import (
    kv_stats,
    retention_state,
    scheduler_state,
    worker_stats,
)
from tests.conftest import engine_settings
from tests.retention.vlm_oracle import (
    SYSTEM,
    TOLERANCE,
    Media,
    VideoSession,
    clip_with_fps,
    drive_and_check,
    frame_clip,
    frame_image,
    frame_prompt,
    preempt_and_check,
    wait_all_blocks_free,
)

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Family:
    model: str
    media: Media  # the oracle tests' frames (Qwen3-VL: 112 px is resized to 128, 16 tokens)
    small: Media  # the endurance test's: 4 tokens per image, 8 per clip


FAMILIES = {
    "tiny-qwen3-vl": Family(
        "tiny-qwen3-vl",
        Media(clip_fps=2.0),
        Media(image_size=64, clip_size=64, clip_fps=2.0),
    ),
    "tiny-qwen2.5-vl": Family(
        "tiny-qwen2.5-vl",
        Media(clip_fps=2.0),
        Media(image_size=56, clip_size=56, clip_fps=2.0),
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> Family:
    return FAMILIES[request.param]


@pytest.fixture(scope="module")
async def engine(family: Family) -> AsyncIterator[Any]:
    from realtime.engine import start_engine

    engine = start_engine(
        engine_settings(family.model, extra={"limit_mm_per_prompt": {"image": 1, "video": 1}})
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def hf_vlm(family: Family) -> Any:
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(
        str(model_dir(family.model)), dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@pytest.fixture(scope="module")
def processor(family: Family) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(model_dir(family.model)))


async def test_plain_streams_take_none_of_our_paths_until_a_bounded_session(
    engine: Any, family: Family
) -> None:
    """The first test on each family's fresh engine (pytest runs a module's tests in file order
    per family). A plain streaming request with image chunks gets stock vLLM's outputs
    (`kv_transfer_params` None) and leaves the scheduler without the model's position function;
    the first bounded session binds it."""
    from vllm import SamplingParams
    from vllm.engine.protocol import StreamingInput

    assert await scheduler_state(engine) == {
        "bounded_sessions": 0,
        "mrope_position_function": False,
    }, "this test needs an engine that has served no bounded session"

    async def chunks() -> AsyncIterator[Any]:
        for i in range(2):
            image = frame_image(i, family.small.image_size)
            prompt = (SYSTEM if i == 0 else "") + frame_prompt(i)
            yield StreamingInput(prompt={"prompt": prompt, "multi_modal_data": {"image": image}})

    plain = SamplingParams(max_tokens=2, temperature=0.0)
    outputs = [out async for out in engine.generate(chunks(), plain, request_id="plain-stream")]
    assert sum(o.outputs[0].finish_reason is not None for o in outputs) == 2  # both chunks
    assert [o.kv_transfer_params for o in outputs] == [None] * len(outputs)
    assert (await scheduler_state(engine))["mrope_position_function"] is False

    session = VideoSession(engine, {"sink_chunks": 1, "window_chunks": 2})
    try:
        image = frame_image(0, family.small.image_size)
        await session.send(SYSTEM + frame_prompt(0), {"image": image})
        assert await scheduler_state(engine) == {
            "bounded_sessions": 1,
            "mrope_position_function": True,
        }
    finally:
        await session.close()


@pytest.mark.v2
async def test_eviction_of_image_and_clip_chunks_matches_oracle(
    engine: Any, hf_vlm: Any, processor: Any, family: Family
) -> None:
    budget = {"sink_chunks": 1, "window_chunks": 3, "low_watermark_ratio": 0.34}
    report = await drive_and_check(
        engine, hf_vlm, processor, budget, num_frames=10, video_every=2, media=family.media
    )
    state = report["state"]
    print(
        f"{family.model} eviction oracle: max |Δ logprob| = {report['max_diff']:.2e}, "
        f"renumbered gap = {report['renumber_gap']:.2e}, evicted {sorted(report['evicted_kinds'])}"
    )
    assert report["evicted_kinds"] == {"image", "video"}
    assert report["evicted_checks"] >= 4
    assert state["evictions"] >= 2 and state["consolidations"] == 0
    assert state["encoder_entries_released"] >= 4
    # Stock vLLM's renumbering would be visibly wrong: the oracle tells them apart.
    assert report["renumber_gap"] > 10 * TOLERANCE
    stats = await wait_all_blocks_free(engine)
    assert stats["num_free_blocks"] == stats["num_usable_blocks"]


@pytest.mark.v2
async def test_consolidation_matches_fresh_prefill_of_survivors(
    engine: Any, hf_vlm: Any, processor: Any, family: Family
) -> None:
    budget = {
        "sink_chunks": 1,
        "window_chunks": 2,
        "low_watermark_ratio": 0.5,
        "max_position": 240,
    }
    report = await drive_and_check(
        engine,
        hf_vlm,
        processor,
        budget,
        num_frames=12,
        seed=100,
        reset_encoder_cache=True,
        video_every=3,
        media=family.media,
        track_positions=True,
    )
    print(
        f"{family.model} consolidation oracle: max |Δ logprob| = {report['max_diff']:.2e}, "
        "encoder runs per re-prefill (runs, frames):",
        report["reprefill_encoder_runs"],
    )
    assert report["consolidated_checks"] >= 2
    # The encoder cache was emptied: every surviving frame (clips included) was encoded again
    # from the pixel data the scheduler keeps for held items, and the oracle above agrees.
    assert all(runs == frames for runs, frames in report["reprefill_encoder_runs"])
    assert all(p["top"] <= 240 for p in report["positions"]), report["positions"]


@pytest.mark.v2
async def test_preempted_session_resumes_as_a_fresh_prefill(
    engine: Any, hf_vlm: Any, processor: Any, family: Family
) -> None:
    report = await preempt_and_check(engine, hf_vlm, processor, media=family.media)
    print(
        f"{family.model} preemption oracle: max |Δ logprob| = {report['max_diff']:.2e}, "
        f"orphans {report['orphans']}, probe cached tokens {report['cached']}"
    )


async def test_temporal_scaling_outgrows_tokens_and_consolidates_before_max_position(
    engine: Any, hf_vlm: Any, processor: Any, family: Family
) -> None:
    if family.model != "tiny-qwen2.5-vl":
        pytest.skip("only Qwen2.5-VL scales a clip's temporal positions by its duration")
    # 4 frames of 56 px at 0.25 fps: grid (2, 4, 4) -> 8 tokens; second_per_grid_ts 8 s ×
    # tokens_per_second 4 -> the second temporal patch sits 32 positions after the first, so
    # the clip spans 33 positions with 8 tokens (an excess of 25 per chunk).
    limit = 240
    budget = {
        "sink_chunks": 1,
        "window_chunks": 2,
        "low_watermark_ratio": 0.5,
        "max_position": limit,
    }
    slow_clips = Media(image_size=56, clip_size=56, clip_fps=0.25)
    report = await drive_and_check(
        engine,
        hf_vlm,
        processor,
        budget,
        num_frames=14,
        seed=700,
        video_every=1,
        media=slow_clips,
        track_positions=True,
    )
    positions = report["positions"]
    for p in positions:
        print(f"{family.model} scaled clips:", p)
    print(f"{family.model} scaled clips oracle: max |Δ logprob| = {report['max_diff']:.2e}")
    outgrown = max(p["top"] - p["columns"] for p in positions)
    # Positions outgrew the tokens by more than the whole window's worth of tokens: a cursor
    # counting tokens would have let them pass max_position.
    assert outgrown > 60, positions
    assert report["state"]["consolidations"] >= 2
    # Consolidated before max_position, never after: every position the worker handed out
    # (the prompt's and the decoded tokens') stayed below it.
    assert all(p["top"] <= limit for p in positions), positions


ENDURANCE_FRAMES = 1000


async def test_endurance_1000_frames_bounded_and_no_leak(engine: Any, family: Family) -> None:
    stats0 = await wait_all_blocks_free(engine)
    usable = stats0["num_usable_blocks"]
    assert stats0["num_free_blocks"] == usable
    limit = 2000
    budget = {
        "sink_chunks": 1,
        "window_chunks": 3,
        "low_watermark_ratio": 0.34,
        "max_position": limit,
    }
    media = family.small
    session = VideoSession(engine, budget, max_tokens=1)
    samples: list[dict[str, Any]] = []
    started = time.perf_counter()
    try:
        await session.send(SYSTEM)
        for i in range(1, ENDURANCE_FRAMES + 1):
            if i % 10 == 0:
                clip = frame_clip(20_000 + i, media.clip_frames, media.clip_size)
                assert media.clip_fps is not None
                data = {"video": clip_with_fps(clip, media.clip_fps)}
                await session.send(frame_prompt(i, "video"), data)
            else:
                data = {"image": frame_image(20_000 + i, media.image_size)}
                await session.send(frame_prompt(i), data)
            if i % 50 == 0 or i == 10:
                kv = await kv_stats(engine)
                (worker,) = await worker_stats(engine)
                state = await retention_state(engine, session.request_id)
                assert state is not None
                samples.append(
                    {
                        "frame": i,
                        "blocks": kv["blocks_by_request"].get(session.request_id, 0),
                        "encoder_entries": kv["encoder_cache_entries"],
                        "worker_encoder_entries": worker["encoder_cache_entries"],
                        "mrope_columns": worker["mrope_columns_by_request"][session.request_id],
                        "mrope_top": worker["mrope_top_by_request"][session.request_id],
                        "tokens_held": state["tokens_held"],
                        "mm_items_held": state["mm_items_held"],
                    }
                )
        state = await retention_state(engine, session.request_id)
        assert state is not None
    finally:
        await session.close()
    elapsed = time.perf_counter() - started
    print(f"{family.model} endurance: {ENDURANCE_FRAMES} frames in {elapsed:.0f} s")
    for s in samples[:: max(1, len(samples) // 5)] + samples[-1:]:
        print(f"{family.model} endurance", s)
    assert state["evictions"] > 100 and state["consolidations"] >= 5
    assert state["mm_items_with_data"] <= state["mm_items_held"] <= 6
    # Window of 3 small frames (~25-35 tokens each) + sink + remnants: a few 32-token blocks.
    assert max(s["blocks"] for s in samples) <= 8
    assert max(s["mm_items_held"] for s in samples) <= 6
    # Encoder-cache entries: this session's held items on top of what earlier sessions left
    # (stock vLLM frees a finished request's entries lazily, under pressure).
    base = stats0["encoder_cache_entries"]
    assert all(s["encoder_entries"] <= base + s["mm_items_held"] for s in samples), base
    assert all(s["worker_encoder_entries"] <= base + s["mm_items_held"] for s in samples), base
    assert max(s["mrope_columns"] for s in samples) <= 8 * 32
    assert max(s["mrope_top"] for s in samples) <= limit
    # Nothing left at close: every block back, the worker holds no state for the session.
    stats = await wait_all_blocks_free(engine)
    assert stats["num_free_blocks"] == usable
    for _ in range(100):
        (worker,) = await worker_stats(engine)
        if session.request_id not in worker["mrope_columns_by_request"]:
            break
        await asyncio.sleep(0.05)
    assert session.request_id not in worker["mrope_columns_by_request"]
    assert await retention_state(engine, session.request_id) is None


async def test_the_servers_clip_chunk_runs_on_the_family(engine: Any, family: Family) -> None:
    """What the server sends for a clip chunk (realtime.media.decode_clip's frames and their
    metadata, which Qwen2.5-VL and Qwen3-VL require) is accepted and answered."""
    from vllm import SamplingParams

    from realtime.engine_session import chat_format_of, render_chunk
    from tests.reliability.fuzzcore import _clip
    from vllm_realtime_protocol import Frame, SessionConfig

    clip = _clip("mp4", "mpeg4", frames=3, size=64)
    frame = Frame(0, None, "video", "mp4", clip, None, "what?", None)
    prompt = render_chunk(
        frame, SessionConfig(), chat=chat_format_of(engine), first=True, multimodal=True
    )
    final = None
    async for out in engine.generate(
        prompt, SamplingParams(max_tokens=2, temperature=0.0), request_id=f"clip-{family.model}"
    ):
        final = out
    assert final is not None and final.finished
    assert len(final.outputs[0].token_ids) >= 1 and len(final.prompt_token_ids or []) > 16
