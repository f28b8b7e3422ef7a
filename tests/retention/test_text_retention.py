"""Bounded text sessions on the real SmolLM2-135M: in-place eviction, 1D-RoPE offset, consolidation.

Oracles, in float32 (vLLM's CPU kernels and transformers' eager attention differ in summation
order only: measured differences are ~1e-5, so 2e-3 in log-probability is ample, while a wrong
position or a stale KV block moves them by > 0.1):

* After an eviction, the session's next-token log-probabilities equal a dense transformers
  forward pass over every token the session ever received, at its original position, under an
  attention mask that lets each token see exactly what the cache held when it was computed
  (survivors and earlier tokens of its own chunk). This is what in-place eviction computes: a
  surviving token's cached K/V was computed while the now-evicted tokens were still there. A
  forward pass over the survivors ALONE (even at their original positions) recomputes those K/V
  without that context; in a multi-layer model it is a different function, and the test shows
  that it differs (measured here: 0.15-0.38 in log-probability on SmolLM2).
* After a consolidation (re-prefill of the survivors at 0..n-1), the log-probabilities equal a
  fresh dense prefill of the survivors at positions 0..n-1.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from realtime.models import model_dir
from retention.records import SessionReport
from retention.selfcheck import TEXT_TOLERANCE, dense_logprobs, masked_logprobs
from retention.vllm_adapter.introspect import kv_stats, retention_state

pytestmark = pytest.mark.slow

TOLERANCE = TEXT_TOLERANCE
TOP_K = 5


@pytest.fixture(scope="module")
def hf_model() -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir("smollm2-135m-instruct")), dtype=torch.float32
    )
    model.eval()
    return model


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir("smollm2-135m-instruct")))


def note_worst_delta(test: str, worst: float) -> None:
    """The worst |Δ log-prob| a test saw against its oracle, on this process's runner (shown
    with `pytest -s`; docs/history/v2-runner.md compares V1 and V2)."""
    from tests.model_runner_mode import RUNNER

    print(f"\nWORST-DELTA {test} runner={RUNNER} {worst:.3e}")


hf_logprobs = dense_logprobs


class Session:
    """A retention session driven chunk by chunk (one chunk in flight, as the server does)."""

    def __init__(self, engine: Any, budget: dict[str, Any], max_tokens: int = 1) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.engine = engine
        self.request_id = f"retention-{uuid.uuid4().hex[:12]}"
        self.inputs: asyncio.Queue[Any] = asyncio.Queue()
        self.params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            logprobs=TOP_K,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"streaming_retention": budget},
        )
        self.outputs: Any = None
        # EngineCore's report on the output that closed the last chunk.
        self.report: SessionReport | None = None

    async def _stream(self) -> AsyncIterator[Any]:
        while True:
            item = await self.inputs.get()
            if item is None:
                return
            yield item

    async def send(self, token_ids: list[int]) -> tuple[list[int], list[dict[int, float]]]:
        from vllm.engine.protocol import StreamingInput
        from vllm.inputs import TokensPrompt

        self.inputs.put_nowait(StreamingInput(prompt=TokensPrompt(prompt_token_ids=token_ids)))
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
                self.report = SessionReport.from_wire(out.kv_transfer_params)
                return tokens, logprobs

    async def close(self) -> None:
        if self.outputs is not None:
            await self.outputs.aclose()
        await self.engine.abort(self.request_id)


def chunk_tokens(tokenizer: Any, i: int) -> list[int]:
    text = f"Note {i}: the river carried {i % 7} boats past the old mill at dawn."
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.v2
async def test_eviction_matches_masked_dense_oracle_at_original_positions(
    smollm2_engine: Any, hf_model: Any, tokenizer: Any
) -> None:
    budget = {"sink_chunks": 1, "window_chunks": 2, "low_watermark_ratio": 0.5}
    session = Session(smollm2_engine, budget)
    tokens: list[int] = []  # every token ever sent; index == original position
    visible: list[list[int]] = []
    evicted_checked = 0
    worst = 0.0
    try:
        system = list(tokenizer("You keep short notes.", add_special_tokens=False)["input_ids"])
        await session.send(system)
        tokens += system
        visible += [list(range(j + 1)) for j in range(len(system))]
        for i in range(8):
            chunk = chunk_tokens(tokenizer, i)
            _, logprobs = await session.send(chunk)
            state = await retention_state(smollm2_engine, session.request_id)
            assert state is not None
            held = state["history_positions"]
            cursor = state["position_cursor"]
            # Positions continue where the last chunk ended, whatever was evicted.
            assert cursor == len(tokens)
            assert [tokens[p] for p in held] == state["token_ids"]
            visible += [held + list(range(cursor, cursor + j + 1)) for j in range(len(chunk))]
            tokens += chunk
            want = masked_logprobs(hf_model, tokens, visible)
            got = logprobs[0]
            for tok, lp in got.items():
                assert abs(lp - float(want[tok])) < TOLERANCE, (i, tok, lp, float(want[tok]))
                worst = max(worst, abs(lp - float(want[tok])))
            assert max(got, key=got.__getitem__) == int(want.argmax())
            if state["tokens_evicted"]:
                evicted_checked += 1
                survivors = state["token_ids"] + chunk
                at_positions = held + list(range(cursor, cursor + len(chunk)))
                alone = hf_logprobs(hf_model, survivors, at_positions)
                # The survivors-only pass is a different function (see the module docstring).
                assert max(abs(lp - float(alone[t])) for t, lp in got.items()) > 10 * TOLERANCE
        assert evicted_checked >= 3
        assert state["evictions"] >= 1 and state["tokens_evicted"] >= 32
        note_worst_delta("eviction", worst)
    finally:
        await session.close()


@pytest.mark.v2
async def test_consolidation_matches_fresh_prefill(
    smollm2_engine: Any, hf_model: Any, tokenizer: Any
) -> None:
    budget = {
        "sink_chunks": 1,
        "window_chunks": 2,
        "low_watermark_ratio": 0.5,
        "max_position": 200,
        "consolidation": "reprefill",
    }
    session = Session(smollm2_engine, budget)
    consolidated_checked = 0
    worst = 0.0
    try:
        await session.send(list(tokenizer("Keep notes.", add_special_tokens=False)["input_ids"]))
        last_consolidations = 0
        for i in range(30):
            chunk = chunk_tokens(tokenizer, i)
            _, logprobs = await session.send(chunk)
            state = await retention_state(smollm2_engine, session.request_id)
            assert state is not None
            assert state["position_cursor"] <= 200
            if state["consolidations"] > last_consolidations:
                last_consolidations = state["consolidations"]
                tokens = state["token_ids"] + chunk
                # After a consolidation the survivors sit at 0..n-1: a fresh prefill.
                assert state["history_positions"] == list(range(len(state["token_ids"])))
                want = hf_logprobs(hf_model, tokens, list(range(len(tokens))))
                for tok, lp in logprobs[0].items():
                    assert abs(lp - float(want[tok])) < TOLERANCE
                    worst = max(worst, abs(lp - float(want[tok])))
                consolidated_checked += 1
        assert consolidated_checked >= 2
        note_worst_delta("consolidation-reprefill", worst)
    finally:
        await session.close()


async def _streamed_outputs(engine: Any, params: Any, request_id: str, chunks: int) -> list[Any]:
    """Every output of a streaming request of `chunks` token chunks, read to its end."""
    from vllm.engine.protocol import StreamingInput
    from vllm.inputs import TokensPrompt

    async def stream() -> AsyncIterator[Any]:
        for i in range(chunks):
            yield StreamingInput(
                prompt=TokensPrompt(prompt_token_ids=list(range(100 + i, 140 + i)))
            )

    outputs = []
    async for out in engine.generate(stream(), params, request_id=request_id):
        assert await retention_state(engine, request_id) is None
        outputs.append(out)
    assert outputs[-1].finished  # the last chunk ends the request
    return outputs


def _boundaries(outputs: list[Any]) -> list[Any]:
    return [o for o in outputs if not o.finished and o.outputs[0].finish_reason is not None]


async def test_plain_streaming_requests_take_no_retention_path(smollm2_engine: Any) -> None:
    """A plain streaming request beside the server's sessions in the same engine: its outputs
    are stock vLLM's (`kv_transfer_params` None, chunk boundaries included), while the
    server's sessions (`EngineSession`, which asks for the report) read theirs at every
    boundary: a bounded one with its retention counters, one without retention without."""
    from vllm import SamplingParams

    from realtime.engine_session import ChunkFinished, EngineSession
    from vllm_realtime_protocol import SamplingConfig

    sampling = SamplingConfig(max_tokens=2, temperature=0.0)
    servers = {
        "bounded": EngineSession(
            smollm2_engine,
            f"bounded-{uuid.uuid4().hex[:8]}",
            sampling,
            {"sink_chunks": 1, "window_chunks": 1},
            idle_consolidation=False,
        ),
        "unbounded": EngineSession(smollm2_engine, f"whole-{uuid.uuid4().hex[:8]}", sampling),
    }

    async def server_chunks(es: EngineSession) -> list[SessionReport | None]:
        reports = []
        for i in range(3):
            prompt = {"prompt_token_ids": list(range(200 + i, 240 + i))}
            async for item in es.run_chunk(prompt, es.chunk_params(reply=True)):
                if isinstance(item, ChunkFinished):
                    reports.append(item.report)
        return reports

    plain_id = f"plain-{uuid.uuid4().hex[:8]}"
    try:
        plain, bounded, unbounded = await asyncio.gather(
            _streamed_outputs(smollm2_engine, SamplingParams(max_tokens=2), plain_id, 3),
            server_chunks(servers["bounded"]),
            server_chunks(servers["unbounded"]),
        )
    finally:
        for es in servers.values():
            await es.abort()
    # Three chunks: two boundaries mid-request, then the end. A loop that saw none checked nothing.
    assert len(_boundaries(plain)) == 2
    assert [o.kv_transfer_params for o in plain] == [None] * len(plain)
    assert len(bounded) == len(unbounded) == 3
    assert all(r is not None and r.retention is not None for r in bounded), bounded
    assert all(r is not None and r.retention is None for r in unbounded), unbounded
    # What the server reads from them (response.done, admission): held blocks and tokens.
    assert all(r is not None and r.kv_blocks_held >= 1 for r in bounded + unbounded)
    assert all(es.tokens_in_context > 0 for es in servers.values())


async def test_endurance_2000_chunks_bounded_blocks_and_no_leak(
    smollm2_engine: Any, tokenizer: Any
) -> None:
    stats0 = await kv_stats(smollm2_engine)
    usable = stats0["num_usable_blocks"]
    assert stats0["num_free_blocks"] == usable
    budget = {
        "sink_chunks": 1,
        "window_chunks": 4,
        "low_watermark_ratio": 0.5,
        "max_position": 8000,
    }
    session = Session(smollm2_engine, budget)
    peak_blocks = 0
    try:
        await session.send(list(tokenizer("Count along.", add_special_tokens=False)["input_ids"]))
        for i in range(2000):
            await session.send(list(tokenizer(f" {i}", add_special_tokens=False)["input_ids"]))
            if i % 50 == 0:
                held = (await kv_stats(smollm2_engine))["blocks_by_request"].get(
                    session.request_id, 0
                )
                peak_blocks = max(peak_blocks, held)
        state = await retention_state(smollm2_engine, session.request_id)
        assert state is not None and state["position_cursor"] <= 8000
        assert state["evictions"] > 100
        # The report on the last reply agrees with the full introspection (the chunk just
        # answered counts as retained: it becomes a history segment at the next fold).
        report = session.report
        assert report is not None and report.retention is not None and report.error is None
        assert report.retention.chunks_retained == state["chunks_retained"] + 1
        assert report.retention.chunks_evicted == state["chunks_evicted"]
        assert report.retention.evictions == state["evictions"]
        assert report.retention.consolidations == state["consolidations"]
        held = (await kv_stats(smollm2_engine))["blocks_by_request"][session.request_id]
        assert report.kv_blocks_held == held
    finally:
        await session.close()
    # Sinks (~4 tokens) + window of 4 tiny chunks + remnants: a handful of 32-token blocks.
    assert peak_blocks <= 3, peak_blocks
    for _ in range(100):
        if (await kv_stats(smollm2_engine))["num_free_blocks"] == usable:
            break
        await asyncio.sleep(0.05)
    assert (await kv_stats(smollm2_engine))["num_free_blocks"] == usable


@pytest.mark.v2
async def test_fold_guard_counts_what_the_session_holds_after_eviction(
    smollm2_engine: Any,
) -> None:
    """Defect 2 of the capacity issue: the context guard used the count before the fold's
    eviction: before eviction this session counts sink + 3 chunks + the new one (~1000 tokens
    plus remnants) against 1024; after it, at most sink + 2 chunks + the new one (~800)."""
    import random

    rng = random.Random(5)
    budget = {"sink_chunks": 1, "window_chunks": 2, "low_watermark_ratio": 0.5}
    session = Session(smollm2_engine, budget)
    try:
        for _ in range(8):
            await session.send([rng.randrange(1000, 20000) for _ in range(200)])
        state = await retention_state(smollm2_engine, session.request_id)
        assert state is not None and state["evictions"] >= 2
        assert state["tokens_held"] < 1024
    finally:
        await session.close()
