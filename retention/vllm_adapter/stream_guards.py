"""`StreamingGuards`: the EngineCore-side guards of streaming sessions, a part of the scheduler.

`session_scheduler.RealtimeSessionScheduler` owns one and calls it from vLLM's scheduler hooks;
it runs in the EngineCore process. The front-end half of the hardening is
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
   whole engine (every request gets EngineDeadError). `length_problem` computes the folded
   prompt length (what vLLM's fold keeps + the chunk; `capabilities.folded_length`: the first
   `num_computed_tokens` tokens on 0.32, all but the last sampled one on 0.33) and the fold
   goes ahead only if it stays below max_model_len, the rule vLLM's input processor applies to
   a plain prompt (it needs room for one output token). Otherwise the session is not folded but
   parked (in `_handle_stopped_request`'s path it is set to WAITING_FOR_STREAMING_REQ, so
   vLLM's own enqueueing treats it as blocked and never schedules it) and condemned here. At
   the end of the next `update_from_output`, after the outputs of that step (so a chunk
   boundary emitted in the same step reaches the client first), `emit` finishes it with
   FINISHED_ERROR through vLLM's `finish_requests` (frees its KV and encoder inputs, tells the
   worker) and appends an ERROR output whose `stop_reason` starts with
   `CONTEXT_LENGTH_EXCEEDED` and says why. Nothing else is touched: the engine and every other
   request go on. A bounded session is checked after its fold's eviction and consolidation
   instead (`SessionRetention.after_fold`): against what it will hold, not what it held.

c. Late chunks never resurrect a session. Stock `add_request` adds a resumable request with an
   unknown id as a NEW session; a non-first chunk that arrives after its session ended (abort
   race, engine-side finish) would generate from that chunk alone and park forever with KV
   that no client can abort. The front end tags non-first chunks (CONTINUATION) and the
   end-of-stream request (END); a tagged request for an id that is not a live session is not
   added (`accepts`). A CONTINUATION gets an ERROR output (`LATE_CHUNK_REJECTED`), so a front
   end that still waits for it is released; the id is also reported in `finished_requests`,
   which drops a data-parallel client's routing entry for it. An END is dropped silently (its
   session is gone, there is nothing to end; stock vLLM would run its `[0]` prompt as a new
   request). Chunks for a session already condemned are dropped too; its error output is on
   the way. Untagged requests, first chunks included, are vLLM's.

The scheduler's `has_requests` also reports `pending` errors, so that EngineCore steps once more
(an empty step) to deliver them even when nothing else runs. Requests that are not streaming
sessions never reach any of this: they carry no tag, and `_update_request_as_session` is only
called for sessions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
from vllm.v1.request import Request, RequestStatus, StreamingUpdate

from retention.records import (
    CONTEXT_LENGTH_EXCEEDED,
    LATE_CHUNK_REJECTED,
    SessionErrorCode,
    SessionReport,
)
from retention.vllm_adapter.capabilities import folded_length
from retention.vllm_adapter.streaming import CONTINUATION, stream_role

logger = logging.getLogger(__name__)

__all__ = ["CONTEXT_LENGTH_EXCEEDED", "LATE_CHUNK_REJECTED", "StreamingGuards"]


class StreamingGuards:
    """The late-chunk and context-length guards, and the error outputs they owe (see above)."""

    def __init__(self) -> None:
        # Live sessions to finish with FINISHED_ERROR after the next step: id -> (code, message).
        # The message (also the output's stop_reason, for plain vLLM clients) starts with the code.
        self.errors: dict[str, tuple[SessionErrorCode, str]] = {}
        # Rejected chunks of unknown sessions to answer: (client index, request id, message).
        self.rejected: list[tuple[int, str, str]] = []

    @property
    def pending(self) -> bool:
        """Error outputs wait for the next step's end."""
        return bool(self.errors or self.rejected)

    # ------------------------------------------------------------------ c: late chunks

    def accepts(self, request: Request, live: Request | None) -> bool:
        """Whether `add_request` may hand `request` to vLLM; `live` is the scheduler's request
        of that id, if any. Untagged requests always pass."""
        role = stream_role(request.sampling_params)
        if role is None:
            return True
        request_id = request.request_id
        if request_id in self.errors:
            return False  # the session is being ended with an error already
        if live is not None and not live.is_finished():
            return True
        if role == CONTINUATION:
            message = (
                f"{LATE_CHUNK_REJECTED}: a non-first chunk arrived for streaming session "
                f"{request_id}, which this engine does not know (it has ended); the chunk "
                "was not run"
            )
            logger.warning(message)
            self.rejected.append((request.client_index, request_id, message))
        return False

    # ------------------------------------------------------------------ f: context length

    @staticmethod
    def length_problem(session: Request, update: StreamingUpdate, max_model_len: int) -> str | None:
        """Why folding `update` into an unbounded session would overflow it (None: it fits)."""
        folded_len = folded_length(session, len(update.prompt_token_ids or ()))
        if folded_len < max_model_len:
            return None
        return (
            f"adding this chunk would grow streaming session {session.request_id} to "
            f"{folded_len} tokens; it must stay below max_model_len={max_model_len}"
        )

    def condemn_for_length(self, request_id: str, why: str) -> None:
        """End the session with CONTEXT_LENGTH_EXCEEDED after this step (the scheduler parks it)."""
        message = (
            f"{CONTEXT_LENGTH_EXCEEDED}: {why}. The session was ended; the engine and other "
            "sessions are unaffected."
        )
        logger.warning(message)
        self.errors[request_id] = (CONTEXT_LENGTH_EXCEEDED, message)

    def condemn(self, request_id: str, code: SessionErrorCode, message: str) -> None:
        """End a live session with `code` after this step (the message starts with the code)."""
        logger.warning(message)
        self.errors[request_id] = (code, message)

    # ------------------------------------------------------------------ delivery

    def emit(
        self,
        outputs: dict[int, EngineCoreOutputs],
        finish_requests: Callable[[list[str], RequestStatus], Iterable[Request]],
    ) -> None:
        """Append the owed error outputs to this step's; `finish_requests` is vLLM's."""
        errors, self.errors = self.errors, {}
        # finish_requests skips ids that ended meanwhile (e.g. aborted by the client).
        for request in finish_requests(list(errors), RequestStatus.FINISHED_ERROR):
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
        rejected, self.rejected = self.rejected, []
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
