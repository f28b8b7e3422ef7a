"""A bounded session rebuilt from its snapshot (issue #39) on the real SmolLM2-135M.

A session store rebuilds a session on another replica from the `SessionSnapshot` its last
chunk boundary reported: one chunk whose prompt is the held tokens, recorded by the engine as
the snapshot's history (`policy.RESTORE_KEY`). The oracle: the original session consolidated
by re-prefill (a control chunk) holds the same tokens at the same positions in the same
segments, and answers the next question with the same greedy tokens.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from realtime.engine_session import ChunkFinished, EngineSession
from retention.vllm_adapter.introspect import retention_state
from tests.retention.text_oracle import chunk_tokens
from vllm_realtime_protocol import SamplingConfig

pytestmark = pytest.mark.slow

# Window of 2 chunks: five chunks evict some, so the snapshot holds sinks, survivors and
# (block rounding) remnants.
BUDGET = {"sink_chunks": 1, "window_chunks": 2, "low_watermark_ratio": 0.5}
REPREFILL = {**BUDGET, "consolidation": "reprefill"}


class TokenLog:
    """The engine, with every output token id of the session kept."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.ids: list[int] = []

    def __getattr__(self, name: str) -> Any:
        # The renderer and model config the session renders its chunks with.
        return getattr(self.engine, name)

    def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        inner = self.engine.generate(*args, **kwargs)

        async def gen() -> AsyncIterator[Any]:
            try:
                async for out in inner:
                    if out.outputs:
                        self.ids.extend(out.outputs[0].token_ids)
                    yield out
            finally:
                await inner.aclose()

        return gen()

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)


async def ask(es: EngineSession, log: TokenLog, tokens: list[int]) -> list[int]:
    """One answered chunk; its reply's token ids."""
    start = len(log.ids)
    finished = None
    async for item in es.run_chunk({"prompt_token_ids": tokens}, es.chunk_params(reply=True)):
        if isinstance(item, ChunkFinished):
            finished = item
    assert finished is not None
    return log.ids[start:]


def session(engine: TokenLog, budget: dict[str, Any]) -> EngineSession:
    return EngineSession(
        engine,
        f"restore-{uuid.uuid4().hex[:12]}",
        SamplingConfig(max_tokens=8, temperature=0.0),
        dict(budget),
        idle_consolidation=False,
        snapshots=True,
    )


async def test_a_rebuilt_session_equals_the_original_consolidated(
    smollm2_engine: Any,
    tokenizer: Any,
) -> None:
    log_a, log_b = TokenLog(smollm2_engine), TokenLog(smollm2_engine)
    a, b = session(log_a, REPREFILL), session(log_b, REPREFILL)
    try:
        await ask(a, log_a, list(tokenizer("Keep notes.", add_special_tokens=False)["input_ids"]))
        for i in range(5):
            await ask(a, log_a, chunk_tokens(tokenizer, i))
        snap = a.snapshot
        assert snap is not None
        assert snap.chunks_evicted_total > 0  # the window really slid
        rebuilt = await b.restore(snap, chunks=a.chunks, turn_open=a.turn_open)
        assert rebuilt == len(snap.token_ids)
        # The rebuilt session reports the same tokens and segments (one more consolidation).
        again = b.snapshot
        assert again is not None
        assert again.token_ids == snap.token_ids and again.segments == snap.segments
        assert again.consolidations_total == snap.consolidations_total + 1
        # The original, consolidated by re-prefill now (a control chunk), holds the same.
        await a._consolidate_idle()
        state_a = await retention_state(smollm2_engine, a.request_id)
        assert state_a is not None
        assert state_a["token_ids"] == snap.token_ids
        assert state_a["history_positions"] == list(range(len(snap.token_ids)))
        question = chunk_tokens(tokenizer, 42)
        reply_a = await ask(a, log_a, question)
        reply_b = await ask(b, log_b, question)
        assert reply_a == reply_b and len(reply_a) > 0  # greedy, token for token
        state_b = await retention_state(smollm2_engine, b.request_id)
        state_a = await retention_state(smollm2_engine, a.request_id)
        assert state_a is not None and state_b is not None
        assert state_b["segment_chunks"] == state_a["segment_chunks"]
        assert state_b["token_ids"] == state_a["token_ids"]
    finally:
        await a.abort()
        await b.abort()
