"""Idle consolidation on the real SmolLM2-135M (issue #21), through `EngineSession`.

When the report on a chunk's boundary says the next chunk would consolidate on its own path,
`EngineSession` sends a control chunk at once; the scheduler drops its token, evicts as usual and
re-prefills the window at 0..n-1 (retention/vllm_adapter/eviction.py). Checked here:

* the consolidation happens between chunks (the next chunk's fold does not consolidate), the
  control token never enters the context, and the next reply's log-probabilities equal a fresh
  dense prefill of the surviving window plus the chunk at 0..n-1;
* a chunk sent while the control chunk is still running waits for it and is then answered
  exactly as after an idle consolidation (same oracle), with one consolidation, not two;
* the report of a control chunk does not count it as a retained chunk and asks for no other.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from realtime.engine_session import ChunkFinished, EngineSession
from retention.vllm_adapter.introspect import kv_stats, retention_state
from tests.retention.text_oracle import TOLERANCE, chunk_tokens, hf_logprobs
from vllm_realtime_protocol import SamplingConfig

pytestmark = pytest.mark.slow

# Idle consolidation moves a re-prefill off the chunk's path; a rotation needs no idle time.
BUDGET = {
    "sink_chunks": 1,
    "window_chunks": 2,
    "low_watermark_ratio": 0.5,
    "max_position": 200,
    "consolidation": "reprefill",
}


class Recording:
    """The engine, with every RequestOutput of the session kept (for the logprobs)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.outputs: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        # The renderer and model config the session renders its chunks with.
        return getattr(self.engine, name)

    def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        inner = self.engine.generate(*args, **kwargs)

        async def gen() -> AsyncIterator[Any]:
            try:
                async for out in inner:
                    self.outputs.append(out)
                    yield out
            finally:
                await inner.aclose()

        return gen()

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)


async def send(es: EngineSession, rec: Recording, tokens: list[int]) -> tuple[dict, ChunkFinished]:
    """One answered chunk; the first reply token's top-5 logprobs and the boundary."""
    params = es.chunk_params(reply=True)
    params.logprobs = 5
    start = len(rec.outputs)
    finished: ChunkFinished | None = None
    async for item in es.run_chunk({"prompt_token_ids": tokens}, params):
        if isinstance(item, ChunkFinished):
            finished = item
    assert finished is not None
    outs = rec.outputs[start:]
    # A control chunk still running when this chunk was sent ends first: skip its boundary.
    ends = [j for j, out in enumerate(outs) if out.outputs and out.outputs[0].finish_reason]
    if len(ends) > 1:
        outs = outs[ends[-2] + 1 :]
    first: dict[int, float] = {}
    for out in outs:
        logprobs = out.outputs[0].logprobs if out.outputs else None
        if logprobs:
            first = {tok: lp.logprob for tok, lp in logprobs[0].items()}
            break
    assert first, "no logprobs on the reply"
    return first, finished


async def assert_all_blocks_free(engine: Any, usable: int) -> None:
    """The aborted session's blocks return to the pool (the abort is asynchronous)."""
    for _ in range(100):
        if (await kv_stats(engine))["num_free_blocks"] == usable:
            break
        await asyncio.sleep(0.05)
    assert (await kv_stats(engine))["num_free_blocks"] == usable


def assert_fresh_prefill(model: Any, state: dict[str, Any], chunk: list[int], got: dict) -> None:
    """The survivors sit at 0..n-1 and the chunk right after them: a fresh dense prefill."""
    survivors = state["token_ids"]
    assert state["history_positions"] == list(range(len(survivors)))
    tokens = survivors + chunk
    want = hf_logprobs(model, tokens, list(range(len(tokens))))
    for tok, lp in got.items():
        assert abs(lp - float(want[tok])) < TOLERANCE, (tok, lp, float(want[tok]))


async def test_idle_consolidation_and_a_chunk_arriving_during_it(
    smollm2_engine: Any,
    hf_model: Any,
    tokenizer: Any,
) -> None:
    rec = Recording(smollm2_engine)
    rid = f"idle-{uuid.uuid4().hex[:12]}"
    es = EngineSession(
        rec,
        rid,
        SamplingConfig(max_tokens=2, temperature=0.0),
        dict(BUDGET),
        ignore_eos=True,
        adapt_idle_to_client=False,  # every due consolidation runs idle, whatever the gaps
    )
    usable = (await kv_stats(smollm2_engine))["num_usable_blocks"]
    checked_idle = checked_during = 0
    try:
        await send(es, rec, list(tokenizer("Keep notes.", add_special_tokens=False)["input_ids"]))
        for i in range(80):
            if checked_idle >= 2 and checked_during >= 2:
                break
            chunk = chunk_tokens(tokenizer, i)
            mode = None
            before: dict[str, Any] | None = None
            if es._idle_task is not None:
                if i % 2 == 0:
                    # Idle: the consolidation finishes before the chunk comes.
                    await es._wait_idle_consolidation()
                    before = await retention_state(smollm2_engine, rid)
                    mode = "idle"
                elif es.consolidating:
                    mode = "during"  # the chunk arrives while the control chunk runs
            got, finished = await send(es, rec, chunk)
            state = await retention_state(smollm2_engine, rid)
            assert state is not None
            assert state["position_cursor"] <= 200
            assert 0 not in state["token_ids"]  # the control token never enters the context
            report = finished.report
            assert report is not None and report.retention is not None
            assert report.retention.consolidations == state["consolidations"]
            if mode == "during":
                # It waited for the control chunk; its own fold did not consolidate again
                # (one consolidation for both), and it sees the consolidated window.
                assert state["consolidations"] == state["idle_consolidations"]
                assert_fresh_prefill(hf_model, state, chunk, got)
                checked_during += 1
            elif mode == "idle":
                assert before is not None
                # Consolidated while idle: this chunk's fold neither consolidated nor evicted.
                assert state["consolidations"] == before["consolidations"]
                assert state["tokens_evicted"] == before["tokens_evicted"]
                assert state["token_ids"] == before["token_ids"]
                assert_fresh_prefill(hf_model, before, chunk, got)
                checked_idle += 1
        assert checked_idle >= 2 and checked_during >= 2, (checked_idle, checked_during)
        # Every consolidation ran while idle (the chunk's own path never consolidated).
        state = await retention_state(smollm2_engine, rid)
        assert state is not None
        assert state["consolidations"] == state["idle_consolidations"] == es.idle_consolidations
        # A control chunk answers nothing: its report counts no chunk and asks for no other.
        if es._idle_task is None:
            await send(es, rec, chunk_tokens(tokenizer, 99))
            for j in range(100, 120):
                if es._idle_task is not None:
                    break
                await send(es, rec, chunk_tokens(tokenizer, j))
        answered = es.last_report
        await es._wait_idle_consolidation()
        control = es.last_report
        assert answered is not None and answered.retention is not None
        assert control is not None and control.retention is not None
        assert answered.retention.consolidate_when_idle
        assert not control.retention.consolidate_when_idle
        assert control.retention.consolidations == answered.retention.consolidations + 1
        held = await retention_state(smollm2_engine, rid)
        assert held is not None
        assert control.retention.chunks_retained == held["chunks_retained"]
        assert control.tokens_in_context == held["tokens_held"]
    finally:
        await es.abort()
    await assert_all_blocks_free(smollm2_engine, usable)


async def test_a_client_without_idle_time_gets_its_consolidations_inline(
    smollm2_engine: Any,
    tokenizer: Any,
) -> None:
    # Chunks sent back to back leave no gap: once a consolidation is known to take longer than
    # the client's gaps, EngineSession leaves the next one to the chunk's own fold (one pass)
    # instead of making that chunk wait for a control chunk.
    rid = f"busy-{uuid.uuid4().hex[:12]}"
    rec = Recording(smollm2_engine)
    es = EngineSession(
        rec,
        rid,
        SamplingConfig(max_tokens=2, temperature=0.0),
        dict(BUDGET),
        ignore_eos=True,
    )
    usable = (await kv_stats(smollm2_engine))["num_usable_blocks"]
    try:
        for i in range(60):
            await send(es, rec, chunk_tokens(tokenizer, i))
            if es.idle_consolidations and es._last_consolidation_s is not None:
                # The measured duration stands for a slow consolidation (a 2-core machine's
                # timing would make the test flaky): no back-to-back gap is that long.
                es._last_consolidation_s = 60.0
            if es.idle_consolidations_skipped >= 2:
                break
        assert es.idle_consolidations_skipped >= 2
        state = await retention_state(smollm2_engine, rid)
        assert state is not None
        assert state["consolidations"] > state["idle_consolidations"] == es.idle_consolidations
        assert state["position_cursor"] <= 200
    finally:
        await es.abort()
    await assert_all_blocks_free(smollm2_engine, usable)
