"""`RetentionScheduler`: vLLM's Scheduler plus the EngineCore-side guards of streaming sessions.

Selected through vLLM's `scheduler_cls` ("module.Class", see realtime/engine.py), directly or
through a subclass (`bounded_scheduler.BoundedSessionScheduler` adds retention on top); it runs
in the EngineCore process. The front-end half of the hardening is
`retention.vllm_adapter.streaming` (read its docstring first: session model and tags).

Theory of operation
===================

A streaming session is one resumable `Request`. When a chunk stops, vLLM's
`_handle_stopped_request` either folds the next queued chunk in at once or parks the request in
WAITING_FOR_STREAMING_REQ (it keeps its KV blocks); `add_request` folds a chunk that arrives for
a parked session. Both folds go through `_update_request_as_session`. Two guards are added:

f. Cumulative context length, checked at the fold. vLLM validates each chunk's own length in
   the front end, never the session's: a fold past max_model_len reaches the worker, whose
   per-request token buffer is max_model_len wide, and the broadcast error there kills the
   whole engine (every request gets EngineDeadError). `_update_request_as_session` computes
   the folded prompt length (what vLLM's fold keeps + the chunk; `capabilities.folded_length`:
   the first `num_computed_tokens` tokens on 0.32, all but the last sampled one on 0.33) and
   folds only if it stays below max_model_len, the rule vLLM's input processor applies to a
   plain prompt (it needs room for one output token). Otherwise the session is not folded but
   parked (in `_handle_stopped_request`'s path it is set to WAITING_FOR_STREAMING_REQ, so
   vLLM's own enqueueing treats it as blocked and never schedules it) and recorded in
   `_session_errors`. At the end of the next `update_from_output`, after the outputs of that
   step (so a chunk boundary emitted in the same step reaches the client first), it is
   finished with FINISHED_ERROR through vLLM's `finish_requests` (frees its KV and encoder
   inputs, tells the worker) and an ERROR output is emitted whose `stop_reason` starts with
   `CONTEXT_LENGTH_EXCEEDED` and says why. Nothing else is touched: the engine and every other
   request go on. A bounded session (bounded_scheduler.py) is checked after its fold's eviction
   and consolidation instead: against what it will hold, not what it held.

c. Late chunks never resurrect a session. Stock `add_request` adds a resumable request with an
   unknown id as a NEW session; a non-first chunk that arrives after its session ended (abort
   race, engine-side finish) would generate from that chunk alone and park forever with KV
   that no client can abort. The front end tags non-first chunks (CONTINUATION) and the
   end-of-stream request (END); a tagged request for an id that is not a live session is not
   added. A CONTINUATION gets an ERROR output (`LATE_CHUNK_REJECTED`), so a front end that
   still waits for it is released; the id is also reported in `finished_requests`, which
   drops a data-parallel client's routing entry for it. An END is dropped silently (its
   session is gone, there is nothing to end; stock vLLM would run its `[0]` prompt as a new
   request). Chunks for a session already condemned by the length check are dropped too; its
   error output is on the way. Untagged requests, first chunks included, are vLLM's.

Session reports. Every output that closes a chunk of a live session, and every error output
above, carries one `retention.records.SessionReport` (blocks held, tokens in context, retention
counters, error code), set at the end of `update_from_output`: the server reads the session's
state from the reply itself instead of calling into EngineCore after it. Only outputs with a
finish reason are looked at, so a decode step of other requests costs one attribute test each.

`has_requests` also reports pending error outputs, so that EngineCore steps once more (an
empty step) to deliver them even when nothing else runs.

Requests that are not streaming sessions never reach any of this: they carry no tag, and
`_update_request_as_session` is only called for sessions.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus, StreamingUpdate

from retention.records import (
    CONTEXT_LENGTH_EXCEEDED,
    LATE_CHUNK_REJECTED,
    RetentionCounters,
    SessionErrorCode,
    SessionReport,
)
from retention.vllm_adapter.capabilities import folded_length
from retention.vllm_adapter.streaming import CONTINUATION, stream_role

logger = logging.getLogger(__name__)

__all__ = ["CONTEXT_LENGTH_EXCEEDED", "LATE_CHUNK_REJECTED", "RetentionScheduler"]


# vLLM is imported with follow_imports=skip, so its classes are Any to mypy.
class RetentionScheduler(Scheduler):  # type: ignore[misc]
    """vLLM's Scheduler with the streaming-session guards described in the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Live sessions to finish with FINISHED_ERROR after the next step: id -> (code, message).
        # The message (also the output's stop_reason, for plain vLLM clients) starts with the code.
        self._session_errors: dict[str, tuple[SessionErrorCode, str]] = {}
        # Rejected chunks of unknown sessions to answer: (client index, request id, message).
        self._rejected_chunks: list[tuple[int, str, str]] = []

    # ------------------------------------------------------------------ c: late chunks

    def add_request(self, request: Request) -> None:
        role = stream_role(request.sampling_params)
        if role is not None and not self._accepts_stream_request(request, role):
            return
        super().add_request(request)

    def _accepts_stream_request(self, request: Request, role: str) -> bool:
        request_id = request.request_id
        if request_id in self._session_errors:
            return False  # the session is being ended with an error already
        existing = self.requests.get(request_id)
        if existing is not None and not existing.is_finished():
            return True
        if role == CONTINUATION:
            message = (
                f"{LATE_CHUNK_REJECTED}: a non-first chunk arrived for streaming session "
                f"{request_id}, which this engine does not know (it has ended); the chunk "
                "was not run"
            )
            logger.warning(message)
            self._rejected_chunks.append((request.client_index, request_id, message))
        return False

    # ------------------------------------------------------------------ f: context length

    def _update_request_as_session(self, session: Request, update: StreamingUpdate) -> None:
        folded_len = folded_length(session, len(update.prompt_token_ids or ()))
        if folded_len < self.max_model_len:
            self._fold(session, update)
            return
        self._end_session_for_length(
            session,
            f"adding this chunk would grow streaming session {session.request_id} to "
            f"{folded_len} tokens; it must stay below max_model_len={self.max_model_len}",
        )

    def _fold(self, session: Request, update: StreamingUpdate) -> None:
        """vLLM's own fold, unguarded (subclasses guard after their own bookkeeping)."""
        Scheduler._update_request_as_session(self, session, update)

    def _end_session_for_length(self, session: Request, why: str) -> None:
        """Park the session (never runnable again) and end it with an error after this step."""
        message = (
            f"{CONTEXT_LENGTH_EXCEEDED}: {why}. The session was ended; the engine and other "
            "sessions are unaffected."
        )
        logger.warning(message)
        if session.status != RequestStatus.WAITING_FOR_STREAMING_REQ:
            # Called from _handle_stopped_request: park instead of folding, so that vLLM's
            # _enqueue_waiting_request right after this treats it as blocked, never runnable.
            session.status = RequestStatus.WAITING_FOR_STREAMING_REQ
            self.num_waiting_for_streaming_input += 1
        self._session_errors[session.request_id] = (CONTEXT_LENGTH_EXCEEDED, message)

    # ------------------------------------------------------------------ delivery

    def has_requests(self) -> bool:
        return bool(self._session_errors or self._rejected_chunks) or super().has_requests()

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        outputs: dict[int, EngineCoreOutputs] = super().update_from_output(
            scheduler_output, model_runner_output
        )
        for eco in outputs.values():
            for output in eco.outputs:
                if output.finish_reason is not None and output.kv_transfer_params is None:
                    request = self.requests.get(output.request_id)
                    if request is not None and request.resumable:
                        output.kv_transfer_params = self._session_report(request).to_wire()
        if self._session_errors or self._rejected_chunks:
            self._emit_streaming_errors(outputs)
        return outputs

    def _session_report(self, request: Request) -> SessionReport:
        """What a live session holds now (at its chunk boundary)."""
        managers = self.kv_cache_manager.coordinator.single_type_managers
        held = sum(
            1
            for m in managers
            for block in m.req_to_blocks.get(request.request_id, ())
            if not block.is_null
        )
        return SessionReport(
            kv_blocks_held=held,
            tokens_in_context=int(request.num_computed_tokens),
            retention=self._retention_counters(request),
        )

    def _retention_counters(self, request: Request) -> RetentionCounters | None:
        """A bounded session's counters (None here: bounded_scheduler.py has retention)."""
        return None

    def _emit_streaming_errors(self, outputs: dict[int, EngineCoreOutputs]) -> None:
        errors, self._session_errors = self._session_errors, {}
        # finish_requests skips ids that ended meanwhile (e.g. aborted by the client).
        for request in self.finish_requests(list(errors), RequestStatus.FINISHED_ERROR):
            code, message = errors[request.request_id]
            _append(
                outputs,
                request.client_index,
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=request.get_finished_reason(),
                    stop_reason=message,
                    events=request.take_events(),
                    kv_transfer_params=_error_report(code, message),
                    trace_headers=request.trace_headers,
                ),
            )
        rejected, self._rejected_chunks = self._rejected_chunks, []
        for client_index, request_id, message in rejected:
            _append(
                outputs,
                client_index,
                EngineCoreOutput(
                    request_id=request_id,
                    new_token_ids=[],
                    finish_reason=FinishReason.ERROR,
                    stop_reason=message,
                    kv_transfer_params=_error_report(LATE_CHUNK_REJECTED, message),
                ),
                finished_id=request_id,
            )


def _error_report(code: SessionErrorCode, message: str) -> dict[str, Any]:
    # The session's blocks are freed (or it never had any).
    report = SessionReport(kv_blocks_held=0, tokens_in_context=0, error=code, message=message)
    return report.to_wire()


def _append(
    outputs: dict[int, EngineCoreOutputs],
    client_index: int,
    output: EngineCoreOutput,
    finished_id: str | None = None,
) -> None:
    eco = outputs.get(client_index)
    if eco is None:
        eco = outputs[client_index] = EngineCoreOutputs()
    eco.outputs.append(output)
    if finished_id is not None:
        eco.finished_requests = {*(eco.finished_requests or ()), finished_id}
