"""The streaming-input front end (vLLM's AsyncLLM + retention/vllm_adapter/streaming.py) over a
fake engine core that runs our real scheduler (tests/retention/fake_engine.py).

Runs on every supported vLLM (`make compat`; `make test` on the installed one), so it checks
that our hardening works whichever parts of it vLLM already does itself (capabilities.py):

a. every chunk boundary reaches a consumer that reads only after all chunks are answered;
b. an engine-initiated abort ends the session (finished, the stream ends), it is not a boundary;
c. after `abort` no chunk reaches the engine core, and the client's input stream is closed;
e. a bounded session's front-end prompt is the current chunk only.

The real-engine versions of these tests (tests/retention/test_streaming_hardening.py) also show
what stock vLLM 0.32 does at each point; here only our guarantees are checked.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from vllm.engine.protocol import StreamingInput
from vllm.inputs import TokensPrompt
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams

from retention.policy import REQUEST_ARGS_KEY
from retention.vllm_adapter.streaming import (
    CONTINUATION,
    END,
    STREAM_ROLE_KEY,
    StreamingOutputCollector,
    install_streaming_hardening,
)
from tests.retention.fake_engine import (
    BUDGET,
    FakeEngineCore,
    SchedulerOnly,
    chunk_tokens,
    make_async_llm,
    make_scheduler,
)

pytestmark = pytest.mark.compat

MAX_TOKENS = 2
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
async def front_end() -> AsyncIterator[tuple[Any, FakeEngineCore]]:
    install_streaming_hardening()  # what start_engine does in the front-end process
    engine, core = make_async_llm(make_scheduler(SchedulerOnly, block_size=16, num_blocks=128))
    yield engine, core
    engine.shutdown()


def params(budget: dict[str, Any] | None = None) -> SamplingParams:
    return SamplingParams(
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA,
        extra_args={REQUEST_ARGS_KEY: budget} if budget else None,
    )


def chunk(ids: Sequence[int]) -> StreamingInput:
    return StreamingInput(prompt=TokensPrompt(prompt_token_ids=list(ids)))  # type: ignore[arg-type]


def is_boundary(out: RequestOutput) -> bool:
    return not out.finished and any(c.finish_reason is not None for c in out.outputs)


class Stream:
    """A client input stream the test feeds chunk by chunk; records whether it was closed."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[list[int] | None] = asyncio.Queue()
        self.closed = False

    async def __call__(self) -> AsyncIterator[StreamingInput]:
        try:
            while (ids := await self.queue.get()) is not None:
                yield chunk(ids)
        finally:
            self.closed = True


def sent_for(core: FakeEngineCore, external_id: str) -> list[Any]:
    return [r for r in core.added if getattr(r, "external_req_id", None) == external_id]


async def next_output(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    return await asyncio.wait_for(gen.__anext__(), TIMEOUT_S)


async def until(check: Any) -> None:
    deadline = asyncio.get_running_loop().time() + TIMEOUT_S
    while not check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_every_boundary_reaches_a_consumer_that_falls_behind(
    front_end: tuple[Any, FakeEngineCore],
) -> None:
    engine, core = front_end
    stream = Stream()
    for i in range(3):
        stream.queue.put_nowait(chunk_tokens(i))
    gen = engine.generate(stream(), params(), "a-session")
    first = await next_output(gen)  # starts the session; nothing else is read for a while
    scheduler = core.scheduler
    # All three chunks answered in EngineCore before the consumer reads on.
    await until(lambda: len(sent_for(core, "a-session")) == 3 and not scheduler.running)
    outputs = [first]
    while not is_boundary(outputs[-1]) or len([o for o in outputs if is_boundary(o)]) < 3:
        outputs.append(await next_output(gen))
    boundaries = [o for o in outputs if is_boundary(o)]
    assert len(boundaries) == 3
    # DELTA outputs within a chunk may be merged, never across a boundary: each chunk's
    # MAX_TOKENS tokens, ending with its own boundary.
    tokens_per_chunk: list[int] = []
    count = 0
    for out in outputs:
        count += len(out.outputs[0].token_ids)
        if is_boundary(out):
            tokens_per_chunk.append(count)
            count = 0
    assert tokens_per_chunk == [MAX_TOKENS] * 3
    stream.queue.put_nowait(None)  # end of stream: the session ends, and so does `generate`
    with pytest.raises(StopAsyncIteration):
        await next_output(gen)
    await until(lambda: "a-session" not in str(list(scheduler.requests)))
    # The end-of-stream request was tagged, the later chunks too (StreamingGuards' check).
    roles = [
        (r.sampling_params.extra_args or {}).get(STREAM_ROLE_KEY)
        for r in sent_for(core, "a-session")
    ]
    assert roles[:3] == [None, CONTINUATION, CONTINUATION] and roles[3:] == [END]


async def test_b_an_engine_abort_ends_the_session(front_end: tuple[Any, FakeEngineCore]) -> None:
    engine, core = front_end
    stream = Stream()
    stream.queue.put_nowait(chunk_tokens(0))
    gen = engine.generate(stream(), params(), "b-session")
    out = await next_output(gen)
    while not is_boundary(out):
        out = await next_output(gen)
    (sent,) = sent_for(core, "b-session")
    core.abort_from_engine(sent.request_id)
    out = await next_output(gen)
    assert out.finished and out.outputs[0].finish_reason == "abort"
    with pytest.raises(StopAsyncIteration):
        await next_output(gen)
    # A chunk the client still sends never reaches the engine core: the session is over.
    stream.queue.put_nowait(chunk_tokens(1))
    await until(lambda: stream.closed or stream.queue.empty())
    await asyncio.sleep(0.1)
    assert len(sent_for(core, "b-session")) == 1
    assert sent.request_id not in core.scheduler.requests


async def test_c_after_abort_no_chunk_reaches_the_engine_and_the_stream_is_closed(
    front_end: tuple[Any, FakeEngineCore],
) -> None:
    engine, core = front_end
    stream = Stream()
    stream.queue.put_nowait(chunk_tokens(0))
    gen = engine.generate(stream(), params(), "c-session")
    out = await next_output(gen)
    while not is_boundary(out):
        out = await next_output(gen)
    (sent,) = sent_for(core, "c-session")
    await engine.abort("c-session")
    assert stream.closed  # abort waited for the input stream to end
    stream.queue.put_nowait(chunk_tokens(1))
    await asyncio.sleep(0.1)
    assert len(sent_for(core, "c-session")) == 1
    assert sent.request_id not in core.scheduler.requests
    await gen.aclose()


async def test_e_a_bounded_session_front_end_keeps_only_the_current_chunk(
    front_end: tuple[Any, FakeEngineCore],
) -> None:
    engine, _ = front_end
    stream = Stream()
    gen = engine.generate(stream(), params(BUDGET), "e-session")
    prompts: list[list[int]] = []
    for i in range(4):
        stream.queue.put_nowait(chunk_tokens(i))
        out = await next_output(gen)
        while not is_boundary(out):
            out = await next_output(gen)
        prompts.append(list(out.prompt_token_ids or ()))
    assert prompts == [chunk_tokens(i) for i in range(4)]
    collectors = [
        c
        for c in engine.__dict__["_vllm_realtime_input_streams"].values()
        if c.external_id == "e-session"
    ]
    assert len(collectors) == 1 and isinstance(collectors[0], StreamingOutputCollector)
    assert collectors[0].bounded
    await engine.abort("e-session")
    await gen.aclose()
