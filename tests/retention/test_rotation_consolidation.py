"""Consolidation by rotation on the real SmolLM2-135M engine (float32, prefix caching on).

Oracle: with no sinks, a session's survivors are one contiguous run of positions, so rotating
them all to 0..n-1 moves every key and every later query by the same amount. RoPE attention
depends on position differences only: the next-token log-probabilities must equal those of a
twin session that never consolidates (same chunks, same evictions, a position limit it never
reaches). A rotation applied at a wrong index, to a wrong block, or with a wrong angle moves
them by far more than the tolerance.

Production hazard: rotation rewrites blocks in place, so a block another request also holds (a
prefix hit taken before the session's first eviction) must not be rotated: the session falls
back to a re-prefill, and the other request's output stays what it is alone.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from retention.vllm_adapter.introspect import kv_stats, retention_state
from tests.retention.text_oracle import TOLERANCE, Session, chunk_tokens, note_worst_delta

pytestmark = pytest.mark.slow

WINDOW = {"sink_chunks": 0, "window_chunks": 2, "low_watermark_ratio": 0.5}


async def _all_blocks_free(engine: Any) -> bool:
    for _ in range(100):
        stats = await kv_stats(engine)
        if stats["num_free_blocks"] == stats["num_usable_blocks"]:
            return True
        await asyncio.sleep(0.05)
    return False


@pytest.mark.v2
async def test_rotation_changes_no_logit_of_a_contiguous_window(
    smollm2_engine: Any,
    tokenizer: Any,
) -> None:
    rotating = Session(smollm2_engine, {**WINDOW, "max_position": 200, "consolidation": "rotate"})
    twin = Session(smollm2_engine, {**WINDOW, "max_position": 8000, "consolidation": "rotate"})
    compared = 0
    worst = 0.0
    try:
        for i in range(30):
            chunk = chunk_tokens(tokenizer, i)
            (_, got), (_, want) = await asyncio.gather(rotating.send(chunk), twin.send(chunk))
            for tok, lp in want[0].items():
                if tok in got[0]:
                    assert abs(got[0][tok] - lp) < TOLERANCE, (i, tok)
                    worst = max(worst, abs(got[0][tok] - lp))
            best = max(want[0], key=want[0].__getitem__)
            assert best in got[0]
            compared += 1
        state = await retention_state(smollm2_engine, rotating.request_id)
        other = await retention_state(smollm2_engine, twin.request_id)
        assert state is not None and other is not None
        assert state["consolidation"] == "rotate"
        assert state["consolidations"] >= 2 and state["rotations"] == state["consolidations"]
        assert state["rotation_fallbacks"] == 0 and state["idle_consolidations"] == 0
        assert other["consolidations"] == 0
        assert state["position_cursor"] <= 200 < other["position_cursor"]
        assert state["token_ids"] == other["token_ids"]
        # No re-prefill: a rotation frees nothing, so both hold the same blocks.
        blocks = (await kv_stats(smollm2_engine))["blocks_by_request"]
        assert blocks[rotating.request_id] == blocks[twin.request_id]
    finally:
        await rotating.close()
        await twin.close()
    assert compared == 30
    note_worst_delta("consolidation-rotate", worst)
    assert await _all_blocks_free(smollm2_engine)


async def test_a_session_never_asks_for_idle_time_when_it_rotates(
    smollm2_engine: Any,
    tokenizer: Any,
) -> None:
    session = Session(smollm2_engine, {**WINDOW, "sink_chunks": 1, "max_position": 200})
    try:
        for i in range(20):
            await session.send(chunk_tokens(tokenizer, i))
            report = session.report
            assert report is not None and report.retention is not None
            assert not report.retention.consolidate_when_idle
        state = await retention_state(smollm2_engine, session.request_id)
        assert state is not None
        # The engine's default mode: rotation, sinks left where they are.
        assert state["consolidation"] == "rotate" and state["rotations"] >= 1
        assert state["rotations"] == state["consolidations"]
    finally:
        await session.close()
    assert await _all_blocks_free(smollm2_engine)


async def _plain_greedy(
    engine: Any, prompt: list[int], max_tokens: int, started: asyncio.Event | None = None
) -> list[int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    rid = f"plain-{uuid.uuid4().hex[:8]}"
    tokens: list[int] = []
    async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id=rid):
        tokens.extend(out.outputs[0].token_ids)
        if started is not None:
            started.set()
    return tokens


async def test_a_block_shared_with_a_plain_request_is_never_rotated(
    smollm2_engine: Any,
) -> None:
    # Whole 32-token blocks, and replies of one token (never kept: the last sampled token is
    # not in the cache), so the session's cache is exactly first + second + c0 + c1 ...
    # Token ids no other test sends: the only cached copy of these blocks is the session's.
    first = list(range(7000, 7032))
    second = list(range(7100, 7132))
    chunks = [list(range(7200 + 20 * i, 7220 + 20 * i)) for i in range(4)]
    prompt = first + second + [5, 6, 7]
    # Window of 2 chunks, evicted down to 2: the fold of c1 drops `first` only, and with a
    # position limit of 100 it consolidates too (64 + 20 held, c1 + its reply 21 more). The
    # survivor `second` moves from positions 32..63 to 0..31, but its block is shared.
    budget = {**WINDOW, "low_watermark_ratio": 1.0, "max_position": 100, "consolidation": "rotate"}
    session = Session(smollm2_engine, budget)
    try:
        await session.send(first)
        await session.send(second)
        started = asyncio.Event()
        plain = asyncio.ensure_future(_plain_greedy(smollm2_engine, prompt, 64, started))
        await started.wait()  # the plain request holds the session's two blocks now
        for chunk in chunks:
            await session.send(chunk)
        state = await retention_state(smollm2_engine, session.request_id)
        assert state is not None and state["consolidations"] >= 1
        assert state["rotation_fallbacks"] >= 1
        beside = await plain
    finally:
        await session.close()
    assert await _all_blocks_free(smollm2_engine)
    # The session's blocks left the prefix cache with its eviction: this run computes afresh.
    assert beside == await _plain_greedy(smollm2_engine, prompt, 64)
