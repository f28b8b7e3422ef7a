"""Front-end hardening of vLLM's streaming input (AsyncLLM, OutputProcessor).

A realtime session is ONE long-lived vLLM request fed chunk by chunk: the client's chunks are
`StreamingInput`s from an async generator, `AsyncLLM._add_streaming_input_request` sends each as
a `resumable` EngineCoreRequest under the same internal request id, and a last non-resumable
`[0]` request ("end of stream") closes it. In EngineCore each chunk runs until its own
max_tokens/stop; the request then parks in WAITING_FOR_STREAMING_REQ with its KV and the next
chunk is folded into it. In the front end the per-chunk end is visible only as a *transient*
finish_reason on an output whose `finished` is False (the "chunk boundary").

Theory of operation
===================

Four weaknesses of stock 0.32 are closed here, all on the front-end side; the EngineCore side
is `retention.vllm_adapter.stream_guards`, a part of the scheduler. Each one is shown on the real engine
by tests/retention/test_streaming_hardening.py.

a. Boundaries are never merged away. `RequestOutputCollector.put` merges DELTA outputs while
   the consumer is behind, and `RequestOutput.add` overwrites `finish_reason` with the next
   chunk's None: a slow consumer loses boundaries. Streaming sessions get a
   `StreamingOutputCollector`, a FIFO that merges an output into the pending one only while that
   one is still open (no finish_reason, not finished). Within a chunk DELTA merging stays as in
   vLLM; an output that closes a chunk is delivered on its own. An exception is delivered after
   the outputs already pending (vLLM replaces them); after it nothing more is delivered.

b. Engine-initiated ABORT / ERROR is terminal. `OutputProcessor.process_outputs` forces
   `finished=False` on every output of a session whose stream is still open, so an abort from
   EngineCore (pause, shutdown, fault handling) or an error (a chunk that failed EngineCore
   pre-processing, `StreamingGuards`' context-length error) looked like a boundary: the
   consumer waited forever and the next chunk resurrected the session. The wrapper marks such a
   session's stream closed right before vLLM handles that output (the batch is handed to vLLM
   in segments, so an earlier output of the same batch, such as the session's last chunk
   boundary, is still a boundary), so vLLM itself finishes the session (finished=True, state
   freed); and it adds the id to `reqs_to_abort`, because a
   pre-processing error does not free the parked session in the scheduler. Abort of an id the
   scheduler has already freed is a no-op there.

c. No chunk after an abort. `AsyncLLM.abort` (and `generate`'s cancel path, which calls it)
   used to abort while the input-stream task was alive, and `RequestOutputCollector.close`
   only cancels that task. A chunk the task was about to send then went out after the abort,
   registered a fresh request state in the front end and a new resumable request in
   EngineCore, which parked holding KV that nothing ever freed. Now `abort` first cancels the
   input-stream tasks of the streaming sessions it aborts and waits for them to end; only then
   does vLLM's abort run. The input loop also re-checks, before every non-first chunk and
   before end-of-stream, that the front end still knows the session (the check and vLLM's
   registration run without an `await` in between), so a session that ended for any other
   reason is never revived from the front end either. Non-first chunks and end-of-stream are
   tagged (`STREAM_ROLE_KEY` in `SamplingParams.extra_args`, on a copy of the shared params),
   which lets `StreamingGuards` reject what still arrives for an id it does not know.

d. A zero-chunk stream ends cleanly: as in vLLM, STREAM_FINISHED is delivered and nothing is
   sent to EngineCore (the `[0]` end-of-stream request is built only for validation). The
   end-of-stream request of a session that is already over is not sent at all.

e. A bounded session's front-end state stays bounded. vLLM's `RequestState` appends every
   chunk's prompt text and token ids to the session's (`apply_streaming_update`), for the
   session's whole life, while EngineCore holds only the retained window: about 0.7 KB per
   chunk in the soak (tracemalloc, bench/soak.py --trace). For sessions with retention
   (`streaming_retention` in extra_args) the front end keeps only the current chunk's prompt,
   so their `RequestOutput.prompt_token_ids` is that chunk's ids; other sessions keep vLLM's
   cumulative prompt.

Requests that are not streaming sessions take none of these paths: they get vLLM's own
collector from vLLM's own `add_request`; the abort wrapper finds no input-stream task for them
and the output wrapper looks only at ABORT/ERROR outputs of sessions whose stream is open.

vLLM's own input loop (`AsyncLLM._add_streaming_input_request`) runs unchanged: (a) swaps the
collector it returns for ours in place, before its input task first runs, and (b, c, d) act in a
wrapper of `AsyncLLM._add_request`, through which that loop sends every chunk and the
end-of-stream request. A vLLM fix to the loop therefore stays in effect.

Where vLLM already does the same (vLLM 0.33 took over parts of a, b, c and d), ours steps
aside, as the capability record (capabilities.py) says:

* (a) vLLM builds its own `StreamingInputOutputCollector`, which keeps boundaries too: ours is
  still adopted in its place (`streaming_collector`), because it also delivers the outputs
  pending before an error (vLLM's drops them), closes the client's stream at the end and is
  what `abort` finds;
* (b) `process_outputs` treats ABORT/ERROR as final and aborts the session in EngineCore
  itself (`terminal_abort_error`): the wrapper is not installed;
* (c, d) the input loop re-checks `has_request` before each later chunk and before
  end-of-stream (`stream_liveness_check`): our re-check is skipped; the tags stay (vLLM has no
  counterpart of `StreamingGuards`' late-chunk check), and so does `abort`'s wait for the
  input stream.

Everything is installed by `install_streaming_hardening()`, in the front-end process that starts
one of our engines (`realtime/engine.py:start_engine`, through `plugin.install_front_end_hooks`);
it is idempotent.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import weakref
from collections import deque
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterable
from typing import TYPE_CHECKING, Any, Final

from vllm.outputs import PoolingRequestOutput, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.output_processor import RequestOutputCollector, RequestState

from retention.policy import REQUEST_ARGS_KEY
from retention.vllm_adapter.capabilities import vllm_capabilities

if TYPE_CHECKING:
    from vllm.engine.protocol import StreamingInput
    from vllm.pooling_params import PoolingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.output_processor import OutputProcessor, OutputProcessorOutput

logger = logging.getLogger(__name__)

# Tag of a streaming request in `SamplingParams.extra_args` (the field vLLM keeps for plugins).
# The first chunk is untagged, exactly as vLLM sends it.
STREAM_ROLE_KEY: Final = "vllm_realtime.stream_role"
CONTINUATION: Final = "continuation"  # a non-first chunk of a session
END: Final = "end"  # the end-of-stream request
_ROLES: Final = frozenset({CONTINUATION, END})

# How long `abort` waits for an input-stream task it cancelled. A well-behaved client generator
# ends at once; one that swallows cancellation must not hang the abort (the re-check before
# every chunk and StreamingGuards still keep a late chunk from doing harm).
INPUT_STREAM_STOP_TIMEOUT_S: Final = 5.0

_INSTALLED_ATTR: Final = "_vllm_realtime_streaming_hardening"
_STREAMS_ATTR: Final = "_vllm_realtime_input_streams"


def stream_role(params: SamplingParams | None) -> str | None:
    """CONTINUATION, END, or None (first chunk, or not a streaming request)."""
    if params is None or not params.extra_args:
        return None
    role = params.extra_args.get(STREAM_ROLE_KEY)
    return role if role in _ROLES else None


def tag_stream_role(request: EngineCoreRequest, role: str) -> None:
    """Tag a streaming EngineCoreRequest with its role.

    All chunks of a session share one SamplingParams object (vLLM sets skip_clone), so the tag
    goes on a shallow copy with its own extra_args dict; the shared object is left untouched.
    """
    if role not in _ROLES:
        raise ValueError(f"unknown stream role {role!r}")
    params = request.sampling_params
    if params is None:
        raise ValueError("only sampling requests can be streaming chunks")
    tagged = copy.copy(params)
    tagged.extra_args = {**(params.extra_args or {}), STREAM_ROLE_KEY: role}
    request.sampling_params = tagged


def _closes_chunk(output: RequestOutput) -> bool:
    return output.finished or any(c.finish_reason is not None for c in output.outputs)


# vLLM is imported with follow_imports=skip, so its classes are Any to mypy.
class StreamingOutputCollector(RequestOutputCollector):  # type: ignore[misc]
    """The per-session output queue of a streaming session; never merges across a boundary.

    Same interface as vLLM's `RequestOutputCollector` (put / get / get_nowait / close), but a
    FIFO instead of a single slot: an output is merged into the last pending one only while
    that one is open, so every chunk boundary reaches the consumer.
    """

    def __init__(
        self, output_kind: RequestOutputKind, request_id: str, external_id: str | None = None
    ):
        super().__init__(output_kind, request_id)
        self._init_session(request_id if external_id is None else external_id, None, False)

    def _init_session(
        self,
        external_id: str,
        input_stream: AsyncGenerator[StreamingInput, None] | None,
        bounded: bool,
    ) -> None:
        # The client's id, for `abort(external_id)`; request_id is the internal one.
        self.external_id = external_id
        self.bounded = bounded
        self.chunks_sent = 0
        self._input_stream = input_stream
        self._over = False
        self._pending: deque[RequestOutput | PoolingRequestOutput | Exception] = deque()

    @classmethod
    def adopt(
        cls,
        collector: RequestOutputCollector,
        external_id: str,
        input_stream: AsyncGenerator[StreamingInput, None],
        *,
        bounded: bool,
    ) -> StreamingOutputCollector:
        """Turn the collector vLLM just built for a streaming session into this class, in
        place: vLLM's input-stream task already holds that very object. Nothing was put yet.
        Its class is the capability record's `streaming_collector` (vLLM's own streaming
        collector, where it has one: its extra state is empty and left unused)."""
        expected = vllm_capabilities().streaming_collector
        if (
            type(collector) is not expected
            or collector.output is not None
            or getattr(collector, "_backlog", None)
        ):
            raise TypeError(
                f"cannot adopt {type(collector).__name__} (a fresh {expected.__name__} of "
                "this vLLM's streaming input expected)"
            )
        collector.__class__ = cls
        adopted: StreamingOutputCollector = collector
        adopted._init_session(external_id, input_stream, bounded)
        return adopted

    async def end_input(self) -> None:
        """The session is over: close the client's input stream; vLLM's input loop ends next
        (its `InputStreamError` is then dropped, no consumer is left to read it)."""
        self._over = True
        stream, self._input_stream = self._input_stream, None
        if stream is None:
            return
        try:
            await stream.aclose()
        except Exception:
            logger.exception("closing the input stream of %s failed", self.external_id)

    def put(self, output: RequestOutput | PoolingRequestOutput | Exception) -> None:
        if self._over and isinstance(output, Exception):
            return
        pending = self._pending
        last = pending[-1] if pending else None
        if isinstance(last, Exception):
            # After an error nothing more is delivered; a newer error wins, as in vLLM.
            if isinstance(output, Exception):
                pending[-1] = output
            return
        if (
            isinstance(output, RequestOutput)
            and isinstance(last, RequestOutput)
            and not _closes_chunk(last)
        ):
            # Same chunk: merge as vLLM does (DELTA: concatenate). `last` is never the shared
            # STREAM_FINISHED sentinel (it is finished), so the sentinel is never mutated.
            last.add(output, aggregate=self.aggregate)
        else:
            pending.append(output)
        self.ready.set()

    def _take(self) -> RequestOutput | PoolingRequestOutput:
        item = self._pending.popleft()
        if not self._pending:
            self.ready.clear()
        if isinstance(item, Exception):
            raise item
        return item

    async def get(self) -> RequestOutput | PoolingRequestOutput:
        while not self._pending:
            await self.ready.wait()
        return self._take()

    def get_nowait(self) -> RequestOutput | PoolingRequestOutput | None:
        return self._take() if self._pending else None

    def input_stream_task(self) -> asyncio.Task[Any] | None:
        task: asyncio.Task[Any] | None = self._input_stream_task
        return task


def _input_streams(engine: AsyncLLM) -> weakref.WeakValueDictionary[str, StreamingOutputCollector]:
    """Live streaming sessions of this AsyncLLM by internal request id (weak: a session's
    collector lives as long as its `generate`)."""
    streams: weakref.WeakValueDictionary[str, StreamingOutputCollector] | None = (
        engine.__dict__.get(_STREAMS_ATTR)
    )
    if streams is None:
        streams = weakref.WeakValueDictionary()
        engine.__dict__[_STREAMS_ATTR] = streams
    return streams


class _SessionOver(Exception):
    """Raised into vLLM's input loop to end it: the session is over, its next chunk unsent."""


AddStreamingFn = Callable[..., Coroutine[Any, Any, RequestOutputCollector]]
AddRequestFn = Callable[..., Coroutine[Any, Any, None]]


def _make_add_streaming_input_request(original: AddStreamingFn) -> AddStreamingFn:
    """Wraps `AsyncLLM._add_streaming_input_request` instead of copying it.

    vLLM's method builds a `RequestOutputCollector`, starts the input-stream task and returns
    the collector, with no await between starting the task and returning: the task has not
    run yet when the wrapper gets the collector. The wrapper turns it into a
    `StreamingOutputCollector` in place (a) and registers it for `abort` (c). Every send of
    the task goes through `_add_request`, where `_make_add_request` tags, re-checks and skips
    (b, c, d); vLLM's input loop itself runs unchanged."""

    async def _add_streaming_input_request(
        self: AsyncLLM,
        request_id: str,
        input_stream: AsyncGenerator[StreamingInput, None],
        sampling_params: SamplingParams | PoolingParams,
        *args: Any,
        **kwargs: Any,
    ) -> RequestOutputCollector:
        queue = await original(self, request_id, input_stream, sampling_params, *args, **kwargs)
        extra = getattr(sampling_params, "extra_args", None) or {}
        stream = StreamingOutputCollector.adopt(
            queue, request_id, input_stream, bounded=REQUEST_ARGS_KEY in extra
        )
        _input_streams(self)[stream.request_id] = stream  # (c) found by `abort`
        return stream

    _add_streaming_input_request.__doc__ = original.__doc__
    _add_streaming_input_request.__wrapped__ = original  # type: ignore[attr-defined]  # vLLM's, for capabilities.py
    return _add_streaming_input_request


def _make_add_request(original: AddRequestFn) -> AddRequestFn:
    """Wraps `AsyncLLM._add_request` for the sends of a streaming session's input loop.

    A session's first chunk goes as vLLM sends it. Before a later chunk or the end-of-stream
    request, the front end must still know the session (b, c): if it ended (engine abort or
    error, or aborted), a chunk would register as a new request on both sides and an
    end-of-stream `[0]` would run as a placeholder generation (d); instead the chunk ends the
    input loop and the end-of-stream is not sent. No await between this check and vLLM's
    registration. What is sent is tagged (`STREAM_ROLE_KEY`) so that `StreamingGuards`
    drops what still reaches it for an id it no longer knows."""
    upstream_check = vllm_capabilities().stream_liveness_check

    async def _add_request(
        self: AsyncLLM,
        request: EngineCoreRequest,
        prompt: str | None,
        parent_req: Any,
        index: int,
        queue: RequestOutputCollector,
    ) -> None:
        if not isinstance(queue, StreamingOutputCollector):
            await original(self, request, prompt, parent_req, index, queue)
            return
        chunk = bool(request.resumable)
        if queue.chunks_sent:
            # vLLM's own loop makes this check where it can (capabilities.py): then never true.
            if not upstream_check and not self.output_processor.has_request(request.request_id):
                if chunk:
                    await queue.end_input()
                    raise _SessionOver(request.request_id)
                return
            tag_stream_role(request, CONTINUATION if chunk else END)
        await original(self, request, prompt, parent_req, index, queue)
        if chunk and queue.chunks_sent == 0 and queue.bounded:
            # (e) from now on this session's front-end prompt is one chunk long.
            state = self.output_processor.request_states.get(request.request_id)
            if state is not None:
                setattr(state, _BOUNDED_ATTR, True)
        queue.chunks_sent += chunk

    _add_request.__doc__ = original.__doc__
    _add_request.__wrapped__ = original  # type: ignore[attr-defined]  # vLLM's, for capabilities.py
    return _add_request


async def stop_input_streams(engine: AsyncLLM, request_ids: Iterable[str], internal: bool) -> None:
    """Cancel the input-stream tasks of the given streaming sessions and wait until they end.

    Ids are internal or external as for `AsyncLLM.abort`. Sessions that are not streaming, or
    whose input stream has already ended, are skipped. Afterwards no chunk of these sessions
    can be sent any more, so the abort that follows is the last word.
    """
    streams = _input_streams(engine)
    if not streams:
        return
    if internal:
        found = [c for c in map(streams.get, request_ids) if c is not None]
    else:
        wanted = set(request_ids)
        found = [c for c in list(streams.values()) if c.external_id in wanted]
    current = asyncio.current_task()
    tasks: list[asyncio.Task[Any]] = []
    for collector in found:
        task = collector.input_stream_task()
        if task is None or task.done() or task is current:
            continue
        task.cancel()
        tasks.append(task)
    if not tasks:
        return
    _, still_running = await asyncio.wait(tasks, timeout=INPUT_STREAM_STOP_TIMEOUT_S)
    if still_running:
        logger.warning(
            "input stream of %d streaming session(s) did not stop within %.1f s of being "
            "cancelled; aborting anyway",
            len(still_running),
            INPUT_STREAM_STOP_TIMEOUT_S,
        )


AbortFn = Callable[..., Coroutine[Any, Any, None]]


def _make_abort(original: AbortFn) -> AbortFn:
    async def abort(
        self: AsyncLLM, request_id: str | Iterable[str], internal: bool = False
    ) -> None:
        # (c) Stop the input streams first: vLLM aborts while they may still send a chunk.
        if not isinstance(request_id, str):
            request_id = list(request_id)  # may be a one-shot iterable; read twice below
        ids = (request_id,) if isinstance(request_id, str) else request_id
        try:
            await stop_input_streams(self, ids, internal)
        finally:
            # Even if this task is cancelled while it waits, the abort itself must happen; a
            # chunk still in flight then meets the liveness re-check or StreamingGuards.
            await original(self, request_id, internal)

    abort.__doc__ = original.__doc__
    abort.__wrapped__ = original  # type: ignore[attr-defined]  # vLLM's, for capabilities.py
    return abort


ProcessOutputsFn = Callable[..., "OutputProcessorOutput"]


def _make_process_outputs(original: ProcessOutputsFn) -> ProcessOutputsFn:
    from vllm.v1.engine import FinishReason

    terminal = frozenset({FinishReason.ABORT, FinishReason.ERROR})

    def process_outputs(
        self: OutputProcessor,
        engine_core_outputs: list[EngineCoreOutput],
        *args: Any,
        **kwargs: Any,
    ) -> OutputProcessorOutput:
        # (b) An engine-side ABORT/ERROR ends a streaming session: close its stream just
        # before vLLM handles that output, so vLLM reports finished=True and frees the state
        # instead of forcing finished=False and waiting for the next chunk. Only that output:
        # the same batch may carry the session's last chunk boundary first (e.g. the
        # context-length error of StreamingGuards comes right after it), which must stay a
        # boundary. So the batch is handed to vLLM in segments cut before each such output.
        # Candidates: ABORT/ERROR of a session whose stream is open. `streaming_input` only
        # ever goes from True to False, so this is a superset of what is re-checked below;
        # requests that are not streaming sessions never have it set.
        cuts = [
            i
            for i, eco in enumerate(engine_core_outputs)
            if eco.finish_reason is not None
            and eco.finish_reason in terminal
            and (state := self.request_states.get(eco.request_id)) is not None
            and state.streaming_input
        ]
        if not cuts:
            return original(self, engine_core_outputs, *args, **kwargs)
        ended: list[str] = []
        result: OutputProcessorOutput | None = None
        start = 0
        for cut in [*cuts, len(engine_core_outputs)]:
            if cut > start:
                part = original(self, engine_core_outputs[start:cut], *args, **kwargs)
                if result is None:
                    result = part
                else:
                    result.request_outputs.extend(part.request_outputs)
                    result.reqs_to_abort.extend(part.reqs_to_abort)
            if cut < len(engine_core_outputs):
                request_id = engine_core_outputs[cut].request_id
                state = self.request_states.get(request_id)
                if state is not None and state.streaming_input:
                    state.streaming_input = False
                    state.input_chunk_queue = None  # chunks not yet started never run
                    # A chunk that failed EngineCore pre-processing reports ERROR but leaves
                    # the parked session in the scheduler: abort it there too (a no-op for
                    # an id the scheduler has already freed).
                    ended.append(request_id)
            start = cut
        assert result is not None
        result.reqs_to_abort.extend(ended)
        return result

    process_outputs.__doc__ = original.__doc__
    process_outputs.__wrapped__ = original  # type: ignore[attr-defined]  # vLLM's, for capabilities.py
    return process_outputs


_BOUNDED_ATTR: Final = "_vllm_realtime_bounded_session"


def _make_apply_streaming_update(original: Callable[..., None]) -> Callable[..., None]:
    def apply_streaming_update(self: RequestState, update: Any) -> None:
        if getattr(self, _BOUNDED_ATTR, False):
            # (e) vLLM would append this chunk to the whole session's prompt; with no prompt
            # held, it takes the chunk's own text and ids instead.
            self.prompt = None
            self.prompt_token_ids = None
        original(self, update)

    return apply_streaming_update


def install_streaming_hardening() -> None:
    """Idempotently patch AsyncLLM and OutputProcessor as described above."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.output_processor import OutputProcessor

    if getattr(AsyncLLM, _INSTALLED_ATTR, False):
        return
    vllm_capabilities()  # detected on vLLM's own methods, before they are wrapped
    # (a, c) our collector for streaming sessions, registered for `abort`.
    AsyncLLM._add_streaming_input_request = _make_add_streaming_input_request(
        AsyncLLM._add_streaming_input_request
    )
    # (b, c, d) tags, the liveness re-check and no end-of-stream for a session that is over.
    AsyncLLM._add_request = _make_add_request(AsyncLLM._add_request)
    # (c) stop a session's input stream before aborting it.
    AsyncLLM.abort = _make_abort(AsyncLLM.abort)
    if not vllm_capabilities().terminal_abort_error:
        # (b) engine-side ABORT/ERROR is terminal for a streaming session.
        OutputProcessor.process_outputs = _make_process_outputs(OutputProcessor.process_outputs)
    # (e) bounded sessions keep only the current chunk's prompt in the front end.
    RequestState.apply_streaming_update = _make_apply_streaming_update(
        RequestState.apply_streaming_update
    )
    setattr(AsyncLLM, _INSTALLED_ATTR, True)
