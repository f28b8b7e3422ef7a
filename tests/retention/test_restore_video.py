"""A bounded VIDEO session rebuilt from its stored record (issue #39) on the default model,
`smol-qwen2-vl` (SmolLM2-135M inside Qwen2-VL: mRoPE, a trained vision tower).

What a replica stores of a video session (realtime/session_store.py) is the engine's snapshot
(token ids and segments) plus, per retained whole chunk, the frame bytes the client sent; a
rebuild re-passes those frames as `multi_modal_data` with each frame's placeholder run collapsed
to one pad (`engine_session.media_prompt`), in one re-prefill.

The oracle: the original session, consolidated by re-prefill (a control chunk) after evictions,
holds the same tokens in the same segments at positions 0..n-1; its worker holds an mRoPE tensor
of the same width and top; and both answer the next frame with the same greedy tokens and the
same log-probabilities (to 1e-4: one forward of the same function, so any position moved by the
rebuild would show). The frames are prompted the way the server prompts them (`render_chunk`
with the model's registered chat format), as the JPEG and MP4 bytes a client sends.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from realtime.engine_session import (
    ChunkFinished,
    EngineSession,
    render_chunk,
    storable_frames,
    whole_chunks,
)
from realtime.media import decode_clip, decode_image
from realtime.models import registered_chat_format
from realtime.session_store import MediaKind, held_media
from retention.vllm_adapter.introspect import retention_state, worker_stats
from tests.conftest import engine_settings
from tests.realtime.conftest import camera_jpeg
from tests.retention.vlm_oracle import TokenLog
from vllm_realtime_protocol import Frame, SamplingConfig, SessionConfig

pytestmark = pytest.mark.slow

NAME = "smol-qwen2-vl"
# Sinks: the first chunk; window: 2 chunks. Six frames evict three, and block-aligned eviction
# (32-token blocks, ~30-token frame chunks) leaves remnants, which a rebuild drops as the
# mRoPE consolidation does.
BUDGET = {"sink_chunks": 1, "window_chunks": 2, "low_watermark_ratio": 0.5}
REPREFILL = {**BUDGET, "consolidation": "reprefill"}
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
async def smol_engine() -> AsyncIterator[object]:
    from realtime.engine import start_engine

    engine = start_engine(engine_settings(NAME))
    yield engine
    engine.shutdown()


def camera_clip() -> bytes:
    """A short MP4 clip as a client sends one (2 frames of 112x112)."""
    from tests.reliability.fuzzcore import _clip

    return _clip("mp4", "mpeg4", frames=2, size=112)


def frame(
    i: int, data: bytes | None, prompt: str | None = None, kind: MediaKind = "image"
) -> Frame:
    return Frame(
        frame_index=i,
        frame_id=None,
        kind=kind if data is not None else "text",
        media_format=("jpeg" if kind == "image" else "mp4") if data is not None else None,
        data=data or b"",
        text=None if data is not None else "",
        prompt=prompt,
        timestamp=None,
    )


def session(log: TokenLog) -> EngineSession:
    es = EngineSession(
        log,
        f"vrestore-{uuid.uuid4().hex[:12]}",
        SamplingConfig(max_tokens=8, temperature=0.0),
        dict(REPREFILL),
        idle_consolidation=False,
        snapshots=True,
    )
    return es


async def ask(
    es: EngineSession, log: TokenLog, f: Frame, config: SessionConfig
) -> tuple[list[int], list[float]]:
    chat = registered_chat_format(NAME)
    assert chat is not None
    prompt = render_chunk(f, config, chat=chat, first=es.chunks == 0, multimodal=True)
    start = len(log.ids)
    finished = None
    params = es.chunk_params(reply=True, kind="frame")
    async for item in es.run_chunk(prompt, params):
        if isinstance(item, ChunkFinished):
            finished = item
    assert finished is not None
    return log.ids[start:], log.logprobs[start:]


async def test_a_rebuilt_video_session_equals_the_original_consolidated(
    smol_engine: Any,
) -> None:
    config = SessionConfig(modality="video", instructions="Name the colours you see.")
    pad_ids = storable_frames(smol_engine)
    assert pad_ids is not None  # the default model's video sessions can be stored
    log_a, log_b = TokenLog(smol_engine), TokenLog(smol_engine)
    a, b = session(log_a), session(log_b)
    # What a replica stores, kept here the way realtime/connection.py keeps it.
    media: dict[int, MediaKind] = {}
    stored: dict[int, bytes] = {}
    first_new = 0
    try:
        for i in range(6):
            # The last chunk (retained whole) is a clip: images and clips are both stored.
            kind: MediaKind = "video" if i == 5 else "image"
            data = camera_clip() if kind == "video" else camera_jpeg(i)
            await ask(a, log_a, frame(i, data, "What colour?", kind), config)
            media, new_index = held_media(media, a.snapshot, first_new, kind)
            if new_index is not None:
                stored[new_index] = data
            stored = {k: v for k, v in stored.items() if k in media}
            assert a.snapshot is not None
            first_new = a.snapshot.next_index
        snap = a.snapshot
        assert snap is not None
        assert snap.chunks_evicted_total > 0  # the window really slid
        # Only what the next fold keeps: the sink's frame and the window's whole chunks.
        assert set(stored) == set(media) and 0 in stored and len(stored) >= 2
        print("snapshot segments:", snap.segments, "frames stored:", sorted(stored))
        assert any(seg[4] for seg in snap.segments)  # a remnant, which the rebuild drops
        assert media[0] == "image" and media[max(media)] == "video"
        decoded = {
            k: (kind, decode_image(stored[k]) if kind == "image" else decode_clip(stored[k]))
            for k, kind in media.items()
        }
        rebuilt = await b.restore(
            snap, chunks=a.chunks, turn_open=a.turn_open, media=decoded, pad_ids=pad_ids
        )
        whole = whole_chunks(snap)
        assert rebuilt == len(whole.token_ids)
        again = b.snapshot
        assert again is not None
        assert again.token_ids == whole.token_ids and again.segments == whole.segments
        assert again.consolidations_total == snap.consolidations_total + 1
        # The original, consolidated by re-prefill now (a control chunk), holds the same.
        await a._consolidate_idle()
        state_a = await retention_state(smol_engine, a.request_id)
        assert state_a is not None
        assert state_a["token_ids"] == whole.token_ids
        assert state_a["history_positions"] == list(range(len(whole.token_ids)))
        assert state_a["mm_items_held"] == len(stored)
        # The next frame: the same greedy tokens, the same log-probabilities.
        question = frame(6, camera_jpeg(6), "What colour is it?")
        ids_a, lp_a = await ask(a, log_a, question, config)
        ids_b, lp_b = await ask(b, log_b, question, config)
        assert ids_a == ids_b and len(ids_a) > 0, (ids_a, ids_b)
        diff = max(abs(x - y) for x, y in zip(lp_a, lp_b, strict=True))
        print(f"video rebuild oracle: reply {ids_a}, max |Δ logprob| {diff:.2e}")
        assert diff < TOLERANCE
        # Both folded the question in: the same tokens, segments, positions and frames held
        # (the rebuilt one records its history at this, its first fold).
        state_a = await retention_state(smol_engine, a.request_id)
        state_b = await retention_state(smol_engine, b.request_id)
        assert state_a is not None and state_b is not None
        for key in ("token_ids", "segment_chunks", "history_positions", "mm_items_held"):
            assert state_b[key] == state_a[key], key
        (worker,) = await worker_stats(smol_engine)
        for field in ("mrope_columns_by_request", "mrope_top_by_request"):
            assert worker[field][b.request_id] == worker[field][a.request_id], field
    finally:
        await a.abort()
        await b.abort()
