"""Streaming-input hardening (issue "Engine layer", part 2) on the real vLLM 0.32 engine.

One long-lived vLLM request per client session is fed chunk by chunk through vLLM's streaming
input (`StreamingInput` chunks from an async generator, `resumable` requests). Each test first
shows what stock vLLM 0.32 does at one weak point, then the behaviour our layer guarantees:

a. chunk boundaries survive a consumer that falls behind (no DELTA merge across a boundary);
b. an engine-initiated abort or error ends the session, it is never taken as a chunk boundary;
c. abort races: no chunk reaches the engine after an abort, and a late chunk for a finished
   session is rejected instead of resurrecting it as a request nobody can abort;
d. a zero-chunk stream ends cleanly, no placeholder generation runs;
e. folding chunks re-hashes the session's blocks correctly: a second request with the same
   prefix gets exactly the KV a cold request computes (0.32 is correct here; no salt needed);
f. a session that would outgrow max_model_len gets a clear error; the engine and every other
   session live on (stock 0.32: the worker crashes and the whole engine dies);
g. data parallelism: see `test_g_data_parallel_sticky_routing_is_refused_here`;
h. a bounded session's front-end prompt state stays one chunk long (stock 0.32 appends every
   chunk's text and ids to it for the session's life).

The fixes live in retention/vllm_adapter/streaming.py (front end, installed by `start_engine`)
and retention/vllm_adapter/stream_guards.py (`StreamingGuards`, a part of the scheduler, in
EngineCore).

Runtime: every engine step of SmolLM2-135M is ~50-200 ms on 2 cores, so chunks are short and
max_tokens is 2; the shared session engines come from tests/conftest.py. Only the stock-0.32
reproduction of f starts (and kills) a dedicated small engine of its own.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.engine.protocol import StreamingInput
from vllm.inputs import TokensPrompt
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind

from retention.vllm_adapter.introspect import kv_stats
from tests.conftest import engine_settings

STEP_TIMEOUT_S = 20.0


# --------------------------------------------------------------------------- helpers


def token_ids(n: int, seed: int) -> list[int]:
    """n deterministic, ordinary (non-special) SmolLM2 token ids."""
    rng = random.Random(seed)
    return [rng.randrange(1000, 20000) for _ in range(n)]


def chunk(ids: Sequence[int]) -> StreamingInput:
    return StreamingInput(prompt=TokensPrompt(prompt_token_ids=list(ids)))  # type: ignore[arg-type]


def stream_params(max_tokens: int = 2, **kwargs: Any) -> SamplingParams:
    # ignore_eos: every chunk produces exactly max_tokens tokens, so boundaries are predictable.
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
        **kwargs,
    )


def unique_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def completion(out: RequestOutput) -> CompletionOutput:
    assert len(out.outputs) == 1
    return out.outputs[0]


def is_boundary(out: RequestOutput) -> bool:
    return bool(out.outputs) and completion(out).finish_reason is not None


async def next_output(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    return await asyncio.wait_for(gen.__anext__(), STEP_TIMEOUT_S)


async def read_to_boundary(gen: AsyncIterator[RequestOutput]) -> tuple[list[int], RequestOutput]:
    """Read outputs up to and including the next chunk boundary; return its tokens and it."""
    tokens: list[int] = []
    while True:
        out = await next_output(gen)
        tokens.extend(completion(out).token_ids)
        if is_boundary(out):
            return tokens, out


async def eventually(
    check: Callable[[], Awaitable[bool]], timeout: float = STEP_TIMEOUT_S, interval: float = 0.05
) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not await check():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(interval)
    return True


async def engine_holds(engine: Any, external_id: str) -> tuple[int, int]:
    """(KV blocks the EngineCore holds for this external id, requests in its scheduler)."""
    stats = await kv_stats(engine)
    return int(stats["blocks_by_request"].get(external_id, 0)), int(stats["num_requests"])


async def assert_engine_idle(engine: Any) -> None:
    async def idle() -> bool:
        _, n = await engine_holds(engine, "")
        return n == 0 and not engine.output_processor.has_unfinished_requests()

    assert await eventually(idle), await kv_stats(engine)


def internal_id_of(engine: Any, external_id: str) -> str:
    (internal,) = engine.output_processor.external_req_ids[external_id]
    return str(internal)


async def force_cleanup(engine: Any, internal_ids: Sequence[str]) -> None:
    """Leave the shared engine clean even when a test found stock-vLLM behaviour."""
    engine.output_processor.abort_requests(list(internal_ids), internal=True)
    await engine.engine_core.abort_requests_async(list(internal_ids))


# --------------------------------------------------------------------------- a


@pytest.mark.slow
async def test_a_chunk_boundaries_survive_a_slow_consumer(smollm2_engine: Any) -> None:
    """a. Stock 0.32 merges DELTA outputs in `RequestOutputCollector.put` while the consumer is
    behind, and `RequestOutput.add` overwrites `finish_reason` with the next chunk's None: the
    per-chunk boundary marker (finish_reason on a not-finished output) is erased and the
    consumer sees one chunk instead of three. Fixed: `StreamingOutputCollector` never merges
    into an output that closes a chunk."""
    engine = smollm2_engine
    rid = unique_id("a-slow-consumer")
    n_chunks, max_tokens = 3, 2

    async def inputs() -> AsyncIterator[StreamingInput]:
        for i in range(n_chunks):
            yield chunk(token_ids(6, seed=100 + i))

    gen = engine.generate(inputs(), stream_params(max_tokens), rid)
    outs = [await next_output(gen)]
    # Nobody reads while the engine runs all three chunks and the stream ends.
    assert await eventually(lambda: _no_frontend_state(engine, rid))
    outs += [out async for out in gen]

    boundaries = [i for i, out in enumerate(outs) if is_boundary(out)]
    per_chunk: list[list[int]] = []
    start = 0
    for end in boundaries:
        per_chunk.append([t for out in outs[start : end + 1] for t in completion(out).token_ids])
        start = end + 1
    assert len(boundaries) == n_chunks, [(completion(o).finish_reason, o.finished) for o in outs]
    assert [len(tokens) for tokens in per_chunk] == [max_tokens] * n_chunks
    assert all(completion(outs[i]).finish_reason == "length" for i in boundaries)
    await assert_engine_idle(engine)


async def _no_frontend_state(engine: Any, external_id: str) -> bool:
    return external_id not in engine.output_processor.external_req_ids


# --------------------------------------------------------------------------- h


async def test_h_bounded_session_front_end_keeps_only_the_current_chunk(
    smollm2_engine: Any,
) -> None:
    """h. Stock 0.32's `RequestState.apply_streaming_update` appends every chunk's prompt to the
    session's, so the front end's copy grows for the session's whole life (seen: ~0.7 KB per
    chunk in bench/soak.py --trace) while the engine keeps a bounded window. With retention,
    the front end holds the current chunk only; without it, vLLM's cumulative prompt stays."""
    engine = smollm2_engine
    lengths = [9, 5, 7, 6, 8]
    seen: dict[str, list[tuple[int, int]]] = {}
    for label, extra in (
        ("bounded", {"streaming_retention": {"sink_chunks": 1, "window_chunks": 2}}),
        ("plain", None),
    ):
        rid = unique_id(f"h-{label}")
        queue: asyncio.Queue[StreamingInput | None] = asyncio.Queue()

        async def inputs(q: asyncio.Queue[StreamingInput | None] = queue) -> Any:
            while (item := await q.get()) is not None:
                yield item

        gen = engine.generate(inputs(), stream_params(2, extra_args=extra), rid)
        rows = []
        for i, n in enumerate(lengths):
            queue.put_nowait(chunk(token_ids(n, seed=900 + i)))
            _, out = await read_to_boundary(gen)
            state = engine.output_processor.request_states[internal_id_of(engine, rid)]
            rows.append((len(out.prompt_token_ids or []), len(state.prompt_token_ids or [])))
        queue.put_nowait(None)
        async for _ in gen:
            pass
        seen[label] = rows
    assert seen["bounded"] == [(n, n) for n in lengths], seen
    cumulative = [sum(lengths[: i + 1]) for i in range(len(lengths))]
    assert seen["plain"] == [(c, c) for c in cumulative], seen
    await assert_engine_idle(engine)


# --------------------------------------------------------------------------- b


@pytest.mark.slow
async def test_b_engine_abort_ends_the_session(smollm2_engine: Any) -> None:
    """b. An engine-initiated abort (here `pause_generation(mode="abort")`, which aborts every
    request and sends FinishReason.ABORT) reaches a streaming session as a non-finished output
    in stock 0.32: the front end takes it for a chunk boundary, keeps the session open and the
    next chunk resurrects it in EngineCore as a brand-new request with only that chunk's
    prompt. Fixed: ABORT/ERROR finish a streaming session (finished=True), and no further chunk
    or end-of-stream request is sent for it."""
    engine = smollm2_engine
    rid = unique_id("b-engine-abort")
    more = asyncio.Event()
    input_closed = asyncio.Event()

    async def inputs() -> AsyncIterator[StreamingInput]:
        try:
            yield chunk(token_ids(8, seed=200))
            await more.wait()
            yield chunk(token_ids(8, seed=201))
        finally:
            input_closed.set()

    # Every request the front end sends to EngineCore: after the abort, none for this session
    # (the front end's own re-check, not only StreamingGuards' rejection of a late chunk).
    sent: list[str] = []
    core = engine.engine_core
    add_request_async = core.add_request_async

    async def spy(request: Any) -> None:
        sent.append(request.request_id)
        await add_request_async(request)

    core.add_request_async = spy
    gen = engine.generate(inputs(), stream_params(), rid)
    internal: list[str] = []
    try:
        _, boundary = await read_to_boundary(gen)
        internal.append(internal_id_of(engine, rid))
        assert not boundary.finished
        await engine.pause_generation(mode="abort", clear_cache=False)
        await engine.resume_generation()
        aborted = await next_output(gen)
        sent_before = sent.count(internal[0])
        more.set()
        assert completion(aborted).finish_reason == "abort"
        assert aborted.finished, "an engine abort was taken as a chunk boundary"
        with pytest.raises(StopAsyncIteration):
            await next_output(gen)
        await asyncio.wait_for(input_closed.wait(), STEP_TIMEOUT_S)
        await asyncio.sleep(0.3)
        assert await engine_holds(engine, rid) == (0, 0)
        assert sent.count(internal[0]) == sent_before == 1, sent
        assert internal[0] not in engine.output_processor.request_states
    finally:
        core.add_request_async = add_request_async
        more.set()
        await gen.aclose()
        await force_cleanup(engine, internal)
    await assert_engine_idle(engine)


@pytest.mark.slow
async def test_b_engine_error_ends_the_session_and_frees_it(smollm2_engine: Any) -> None:
    """b. EngineCore reports a request-scoped error with a bare FinishReason.ERROR output, e.g.
    `EngineCoreProc._handle_request_preproc_error` when a later chunk fails pre-processing; it
    does not finish the session in the scheduler. Stock 0.32 takes the error for a chunk
    boundary and the parked session keeps its KV. Fixed: the error finishes the session in the
    front end and the front end aborts it in EngineCore. The engine's message is injected into
    the client's output queue exactly as the output socket thread would deliver it."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

    engine = smollm2_engine
    rid = unique_id("b-engine-error")
    more = asyncio.Event()

    async def inputs() -> AsyncIterator[StreamingInput]:
        yield chunk(token_ids(8, seed=210))
        await more.wait()

    gen = engine.generate(inputs(), stream_params(), rid)
    internal: list[str] = []
    try:
        await read_to_boundary(gen)
        internal.append(internal_id_of(engine, rid))
        assert (await engine_holds(engine, rid))[0] > 0  # parked session keeps its KV
        engine.engine_core.outputs_queue.put_nowait(
            EngineCoreOutputs(
                outputs=[EngineCoreOutput(internal[0], [], finish_reason=FinishReason.ERROR)]
            )
        )
        errored = await next_output(gen)
        assert completion(errored).finish_reason == "error"
        assert errored.finished, "an engine error was taken as a chunk boundary"
        assert await eventually(lambda: _engine_forgot(engine, rid))
    finally:
        more.set()
        await gen.aclose()
        await force_cleanup(engine, internal)
    await assert_engine_idle(engine)


async def _engine_forgot(engine: Any, external_id: str) -> bool:
    blocks, _ = await engine_holds(engine, external_id)
    return blocks == 0


# --------------------------------------------------------------------------- c


@pytest.mark.slow
async def test_c_no_chunk_reaches_the_engine_after_abort(smollm2_engine: Any) -> None:
    """c. `AsyncLLM.abort` (and `generate`'s cancel path) aborts while the input-stream task is
    still alive; `RequestOutputCollector.close` only cancels it, never awaits it. A chunk that
    the client produced just before the abort is then sent after it: the front end registers a
    fresh request state, EngineCore (no such id any more) adds it as a new resumable request,
    which generates, parks in WAITING_FOR_STREAMING_REQ and pins KV blocks that nothing ever
    frees. Fixed: abort cancels AND awaits the input-stream task first."""
    engine = smollm2_engine
    rid = unique_id("c-abort-race")
    gate = asyncio.Event()

    async def inputs() -> AsyncIterator[StreamingInput]:
        yield chunk(token_ids(8, seed=300))
        await gate.wait()
        yield chunk(token_ids(8, seed=301))
        await asyncio.Event().wait()  # the client stays connected

    gen = engine.generate(inputs(), stream_params(), rid)
    internal: list[str] = []
    try:
        await read_to_boundary(gen)
        internal.append(internal_id_of(engine, rid))
        gate.set()  # the client's next chunk is ready ...
        await engine.abort(rid)  # ... and the session is aborted in the same instant
        last = await next_output(gen)
        assert last.finished and completion(last).finish_reason == "abort"
        with pytest.raises(StopAsyncIteration):
            await next_output(gen)
        await asyncio.sleep(1.0)  # a resurrected chunk would have been scheduled by now
        assert await engine_holds(engine, rid) == (0, 0), "aborted session resurrected"
        assert rid not in engine.output_processor.external_req_ids
    finally:
        gate.set()
        await gen.aclose()
        await force_cleanup(engine, internal)
    await assert_engine_idle(engine)


@pytest.mark.slow
async def test_c_late_chunk_for_a_finished_or_unknown_session_is_rejected(
    smollm2_engine: Any,
) -> None:
    """c. A non-first chunk (tagged by our front end) whose request id EngineCore does not know
    any more (session finished) or never knew is rejected by `RealtimeSessionScheduler.add_request`
    with an error output; stock 0.32 adds it as a new resumable request that then pins KV in
    WAITING_FOR_STREAMING_REQ forever. A late end-of-stream request is dropped (stock: run as a
    new `[0]` request). They are built and tagged exactly as the front end builds them and sent
    straight to EngineCore, as a send that lost a race would arrive."""
    from retention.vllm_adapter.streaming import CONTINUATION, END, tag_stream_role

    engine = smollm2_engine
    rid = unique_id("c-late-chunk")

    async def one_chunk() -> AsyncIterator[StreamingInput]:
        yield chunk(token_ids(8, seed=310))

    gen = engine.generate(one_chunk(), stream_params(), rid)
    first = await next_output(gen)
    finished_internal = internal_id_of(engine, rid)
    outs = [first] + [out async for out in gen]
    assert sum(len(completion(o).token_ids) for o in outs) == 2
    await assert_engine_idle(engine)

    late_ids = [finished_internal, f"{unique_id('c-never-seen')}-abcdefgh"]
    try:
        for internal in late_ids:
            # A late continuation chunk, then the session's end-of-stream request (d: stock
            # 0.32 would run its [0] prompt as a new request, a placeholder generation).
            for role, ids, resumable in (
                (CONTINUATION, token_ids(8, 311), True),
                (END, [0], False),
            ):
                request = engine.input_processor.process_inputs(
                    request_id=internal,
                    prompt=TokensPrompt(prompt_token_ids=ids),
                    params=stream_params(),
                    supported_tasks=await engine.get_supported_tasks(),
                    resumable=resumable,
                )
                request.external_req_id = internal.rsplit("-", 1)[0]
                tag_stream_role(request, role)
                await engine.engine_core.add_request_async(request)
        await asyncio.sleep(1.0)
        stats = await kv_stats(engine)
        assert stats["num_requests"] == 0, f"late chunks were added as new requests: {stats}"
    finally:
        await force_cleanup(engine, late_ids)
    await assert_engine_idle(engine)


# --------------------------------------------------------------------------- d


@pytest.mark.slow
async def test_d_zero_chunk_stream_ends_cleanly(smollm2_engine: Any) -> None:
    """d. A stream that ends before its first chunk yields nothing and sends nothing to
    EngineCore: stock 0.32 already puts STREAM_FINISHED instead of its `[0]` end-of-stream
    request (not present). The end-of-stream request of a session the engine has already
    finished is never run as a placeholder generation either: our front end does not send it
    (test_b_engine_abort...) and `StreamingGuards` drops one that arrives late
    (test_c_late_chunk...)."""
    engine = smollm2_engine
    rid = unique_id("d-empty")

    async def nothing() -> AsyncIterator[StreamingInput]:
        return
        yield  # an async generator that yields nothing

    outs = [out async for out in engine.generate(nothing(), stream_params(), rid)]
    assert outs == []
    assert await engine_holds(engine, rid) == (0, 0)
    await assert_engine_idle(engine)

    class ClientGone(Exception):
        pass

    async def fails_first() -> AsyncIterator[StreamingInput]:
        raise ClientGone
        yield  # pragma: no cover

    with pytest.raises(ClientGone):
        async for _ in engine.generate(fails_first(), stream_params(), unique_id("d-fail")):
            pass
    await assert_engine_idle(engine)


# --------------------------------------------------------------------------- e


@pytest.mark.slow
async def test_e_folded_blocks_never_serve_stale_kv_to_another_request(
    smollm2_engine: Any,
) -> None:
    """e. When a chunk is folded in, 0.32's `_update_request_as_session` drops the block hashes
    from the first not-computed token on (`block_hashes[num_computed // hash_block_size:]`) and
    re-hashes over the new token chain; only fully computed blocks are ever cached. So a block
    is published under the hash of exactly the tokens whose KV it holds, also the block that
    straddles the fold and the one that held the discarded last sampled token. Shown here: the
    session's first chunk is 62 tokens, so its 2 outputs fill block 1 (positions 32-63) with the
    discarded token at 63. A later plain request with the session's real history hits the
    cached blocks and gets the same tokens and logprobs as a salted (cold) request; one that
    continues with the discarded token does not hit block 1 at all. Not present in 0.32, so
    sessions are NOT salted (a salt would only throw away cross-session prefix reuse). Blocks
    whose content retention rewrites are taken out of the index by kv_range
    (`freeze_request_prefix_caching`), not by a salt."""
    engine = smollm2_engine
    assert engine.vllm_config.cache_config.enable_prefix_caching
    block = 32
    c1, c2 = token_ids(62, seed=400), token_ids(40, seed=401)

    async def inputs() -> AsyncIterator[StreamingInput]:
        yield chunk(c1)
        yield chunk(c2)

    gen = engine.generate(inputs(), stream_params(), unique_id("e-session"))
    out1, _ = await read_to_boundary(gen)
    out2, _ = await read_to_boundary(gen)
    assert [o async for o in gen] == []
    assert len(out1) == len(out2) == 2
    # What EngineCore keeps: every output but the last sampled one of each chunk.
    history = c1 + out1[:1] + c2 + out2[:1]
    with_discarded = c1 + out1 + c2[:30]

    async def plain(ids: list[int], salt: str | None = None) -> RequestOutput:
        prompt = TokensPrompt(prompt_token_ids=ids)
        if salt is not None:
            prompt["cache_salt"] = salt
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=0)
        final = None
        async for out in engine.generate(prompt, params, unique_id("e-plain")):
            final = out
        assert final is not None and final.finished
        return final

    for ids, min_hit, max_hit in (
        (history, 3 * block, len(history)),
        (with_discarded, block, block),  # block 1 held the discarded token: never cached
    ):
        warm = await plain(ids)
        cold = await plain(ids, salt=uuid.uuid4().hex)
        assert cold.num_cached_tokens == 0
        assert warm.num_cached_tokens is not None
        assert min_hit <= warm.num_cached_tokens <= max_hit, warm.num_cached_tokens
        assert list(completion(warm).token_ids) == list(completion(cold).token_ids)
        for lp_warm, lp_cold, tok in zip(
            completion(warm).logprobs or [],
            completion(cold).logprobs or [],
            completion(warm).token_ids,
            strict=True,
        ):
            assert lp_warm[tok].logprob == pytest.approx(lp_cold[tok].logprob, abs=2e-3)
    await assert_engine_idle(engine)


# --------------------------------------------------------------------------- f


@pytest.mark.slow
async def test_f_stock_vllm_dies_when_a_session_outgrows_max_model_len() -> None:
    """f, stock 0.32 (canary for why `StreamingGuards` exists): on a dedicated small engine
    with vLLM's own scheduler, a session whose folded context exceeds max_model_len crashes the
    worker ("could not broadcast input array from shape (261,) into shape (256,)") and every
    request gets EngineDeadError. Kills only its own engine."""
    from vllm.v1.engine.exceptions import EngineDeadError

    from realtime.engine import start_engine

    engine = start_engine(
        engine_settings(
            "smollm2-135m-instruct",
            max_model_len=256,
            kv_cache_memory_bytes=16 << 20,
            extra={"scheduler_cls": "vllm.v1.core.sched.scheduler.Scheduler"},
        )
    )
    try:

        async def inputs() -> AsyncIterator[StreamingInput]:
            yield chunk(token_ids(40, seed=500))
            yield chunk(token_ids(220, seed=501))  # 40 + 1 kept + 220 = 261 > 256

        gen = engine.generate(inputs(), stream_params(), unique_id("f-stock"))
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        assert engine.errored
    finally:
        engine.shutdown()


@pytest.mark.slow
async def test_f_session_outgrowing_max_model_len_gets_an_error_others_live_on(
    smollm2_engine: Any,
) -> None:
    """f, fixed: `RealtimeSessionScheduler._update_request_as_session` checks the cumulative context
    before it folds a chunk in, on both of vLLM's fold paths: a chunk that arrives for a parked
    session (`add_request`, session "parked") and one queued while the previous chunk still
    ran (`_handle_stopped_request`, session "queued"). A session that would reach max_model_len
    (1024) ends with FinishReason.ERROR and a readable stop_reason, after its last boundary;
    its KV is freed; a concurrent session and a plain request on the same engine carry on."""
    from vllm.v1.engine.output_processor import RequestOutputCollector

    from retention.vllm_adapter.stream_guards import CONTEXT_LENGTH_EXCEEDED

    engine = smollm2_engine
    assert engine.model_config.max_model_len == 1024
    parked, queued, other = unique_id("f-parked"), unique_id("f-queued"), unique_id("f-other")
    parked_more, other_more = asyncio.Event(), asyncio.Event()

    async def parked_inputs() -> AsyncIterator[StreamingInput]:
        yield chunk(token_ids(64, seed=600))
        await parked_more.wait()
        # 64 + 1 kept output + 960 = 1025 > 1024; each chunk alone is valid, and the refused
        # one is never computed, so this costs a 64-token prefill.
        yield chunk(token_ids(960, seed=601))
        await asyncio.Event().wait()

    async def queued_inputs() -> AsyncIterator[StreamingInput]:
        yield chunk(token_ids(64, seed=605))
        yield chunk(token_ids(960, seed=606))  # sent while the first chunk still runs

    async def other_inputs() -> AsyncIterator[StreamingInput]:
        yield chunk(token_ids(8, seed=610))
        await other_more.wait()
        yield chunk(token_ids(8, seed=611))

    def assert_length_error(out: RequestOutput) -> None:
        assert out.finished
        assert completion(out).finish_reason == "error"
        reason = str(completion(out).stop_reason)
        assert reason.startswith(CONTEXT_LENGTH_EXCEEDED) and "1025" in reason, reason

    gens = {
        parked: engine.generate(parked_inputs(), stream_params(), parked),
        queued: engine.generate(queued_inputs(), stream_params(), queued),
        other: engine.generate(other_inputs(), stream_params(), other),
    }
    try:
        await read_to_boundary(gens[other])
        tokens, boundary = await read_to_boundary(gens[queued])
        assert len(tokens) == 2 and not boundary.finished
        assert_length_error(await next_output(gens[queued]))
        await read_to_boundary(gens[parked])
        parked_more.set()
        assert_length_error(await next_output(gens[parked]))
        for rid in (parked, queued):
            with pytest.raises(StopAsyncIteration):
                await next_output(gens[rid])
            assert await eventually(lambda rid=rid: _engine_forgot(engine, rid))
        assert not engine.errored

        # The other session goes on, and so does a plain (non-streaming) request, which takes
        # none of the new paths: vLLM's own collector, vLLM's own output.
        other_more.set()
        tokens, boundary = await read_to_boundary(gens[other])
        assert len(tokens) == 2 and completion(boundary).finish_reason == "length"
        assert [o async for o in gens[other]] == []
        queue = await engine.add_request(
            unique_id("f-plain"),
            TokensPrompt(prompt_token_ids=token_ids(8, seed=620)),
            SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        )
        assert type(queue) is RequestOutputCollector
        plain = await asyncio.wait_for(queue.get(), STEP_TIMEOUT_S)
        while not plain.finished:
            plain = await asyncio.wait_for(queue.get(), STEP_TIMEOUT_S)
        assert isinstance(plain, RequestOutput)
        assert len(completion(plain).token_ids) == 2
    finally:
        parked_more.set()
        other_more.set()
        for gen in gens.values():
            await gen.aclose()
    await assert_engine_idle(engine)


# --------------------------------------------------------------------------- g


def test_g_data_parallel_sticky_routing_is_refused_here() -> None:
    """g. Data parallelism and sticky routing.

    What 0.32 does: with data_parallel_size > 1, AsyncLLM's `DPLBAsyncMPClient` routes each
    EngineCoreRequest by load, except that `get_core_engine_for_request` first looks the request
    id up in `reqs_in_flight` ("streaming-input session affinity"): every chunk of a session
    (same internal request id) and its end-of-stream request go to the engine that got its first
    chunk, and aborts follow the same map. The entry is dropped when that engine reports the id
    in `EngineCoreOutputs.finished_requests`. Only a chunk sent after that could be load-balanced
    afresh onto an engine that never saw the session, where stock 0.32 would start it as a new
    session holding only that chunk. With our layer the front end sends no chunk once it knows
    the session ended (b, c), a chunk already in flight still goes to the old engine (the entry
    is dropped only when the front end learns of the end), and a tagged continuation for an
    unknown id is rejected by `RealtimeSessionScheduler.add_request` on whichever engine it reaches,
    which also reports the id in `finished_requests` so the routing entry it created is dropped
    again. Affinity is per front-end process; a session lives in one process, so that suffices.

    On this CPU build (measured once, not part of this file because it costs a minute):
    vLLM's CPU platform accepts data_parallel_size=2 (`create_engine_config` gives
    data_parallel_backend "mp", 2 local ranks) and AsyncLLM started two EngineCore processes
    with `DPLBAsyncMPClient` in ~57 s on 2 cores; four concurrent 3-chunk sessions (with
    StreamingGuards and the front-end patches) each got all 3 chunk boundaries and 6 tokens,
    and `reqs_in_flight` was empty afterwards. Two engines on 2 cores only compete for the same
    cores, so `realtime.engine.start_engine` keeps refusing data_parallel_size > 1 before any
    engine starts; scale-out is one engine per server process, with a session pinned to its
    server by the load balancer in front. This test checks that refusal.
    """
    from realtime.engine import EngineConfigError, start_engine

    settings = engine_settings("smollm2-135m-instruct", extra={"data_parallel_size": 2})
    with pytest.raises(EngineConfigError, match="data parallelism"):
        start_engine(settings)


# --------------------------------------------------------------------------- fast unit tests


def _output(tokens: list[int], finish: str | None = None, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=[1],
        prompt_logprobs=None,
        outputs=[
            CompletionOutput(
                index=0,
                text="",
                token_ids=list(tokens),
                cumulative_logprob=None,
                logprobs=None,
                finish_reason=finish,
            )
        ],
        finished=finished,
    )


async def test_collector_merges_within_a_chunk_never_across_a_boundary() -> None:
    from vllm.outputs import STREAM_FINISHED

    from retention.vllm_adapter.streaming import StreamingOutputCollector

    q = StreamingOutputCollector(RequestOutputKind.DELTA, "r")
    q.put(_output([1]))
    q.put(_output([2], "length"))  # closes chunk 1
    q.put(_output([3]))
    q.put(_output([4]))
    q.put(_output([5], "length"))  # closes chunk 2
    q.put(STREAM_FINISHED)
    got = []
    while (out := q.get_nowait()) is not None:
        assert isinstance(out, RequestOutput)
        got.append(out)
    assert [(list(completion(o).token_ids), completion(o).finish_reason) for o in got[:2]] == [
        ([1, 2], "length"),
        ([3, 4, 5], "length"),
    ]
    assert got[2] is STREAM_FINISHED and STREAM_FINISHED.outputs == []
    assert not q.ready.is_set()


async def test_collector_delivers_pending_outputs_before_an_error() -> None:
    from retention.vllm_adapter.streaming import StreamingOutputCollector

    q = StreamingOutputCollector(RequestOutputKind.DELTA, "r")
    q.put(_output([1], "length"))
    q.put(RuntimeError("boom"))
    q.put(_output([2]))  # after an error nothing more is delivered
    first = await q.get()
    assert isinstance(first, RequestOutput) and list(completion(first).token_ids) == [1]
    with pytest.raises(RuntimeError, match="boom"):
        await q.get()
    assert q.get_nowait() is None


def test_stream_role_tag_copies_the_shared_sampling_params() -> None:
    from vllm.v1.engine import EngineCoreRequest

    from retention.vllm_adapter.streaming import CONTINUATION, END, stream_role, tag_stream_role

    shared = stream_params(extra_args={"user": 1})
    requests = [
        EngineCoreRequest(
            request_id="r-12345678",
            prompt_token_ids=[1],
            mm_features=None,
            sampling_params=shared,
            pooling_params=None,
            arrival_time=0.0,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
            resumable=True,
        )
        for _ in range(3)
    ]
    tag_stream_role(requests[1], CONTINUATION)
    tag_stream_role(requests[2], END)
    assert [stream_role(r.sampling_params) for r in requests] == [None, CONTINUATION, END]
    assert shared.extra_args == {"user": 1}
    assert requests[2].sampling_params is not None
    assert requests[2].sampling_params.extra_args is not None
    assert requests[2].sampling_params.extra_args["user"] == 1
