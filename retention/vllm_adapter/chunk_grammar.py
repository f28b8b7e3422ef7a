"""A chunk's structured-output grammar, carried into its streaming-input session (vLLM 0.32).

A part of `session_scheduler.RealtimeSessionScheduler`: it installs the carrying update once
(`install_chunk_grammar_update`) and calls `take_chunk_grammar` after every session fold.

Theory of operation: vLLM builds a request's grammar (`Request.structured_output_request`) when the
request is created (EngineCore's input thread compiles it, `grammar_init`), and for a
streaming-input session that is the FIRST chunk's only: `StreamingUpdate.from_request` carries a
chunk's prompt, sampling params and max_tokens but not its grammar, and the fold
(`Scheduler._update_request_as_session`) leaves `session.structured_output_request` as it was.
After the first reply the grammar's matcher is terminated (it accepted EOS), and
`StructuredOutputManager._fill_bitmasks` fills a FULL mask for a terminated grammar: every later
reply would be unconstrained (and a first chunk without a format would leave every later one
unconstrained too). Here every chunk brings its own grammar, fresh (None: free text, e.g. an
ingested frame): `StreamingUpdate` carries the chunk request's `structured_output_request`, and
the fold installs it, so the matcher starts at the chunk's first sampled token and never sees
the previous chunk's tokens. A grammar still compiling parks the session in vLLM's own
WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR state (the waiting loop promotes it once compiled).

Measured (tests/realtime/test_watch_and_ask.py, tiny VLM, xgrammar): 40 answered frames among
50 (every fifth ingested), all `completed` and schema-valid, then a per-chunk `json_object`
override and back to the schema. The earlier "escape" ('{"person":false,"level":"l' with no
closing quote) was a reply cut by max_tokens 24 (the model spelled the JSON in small tokens),
reported `incomplete`: not an escape.
"""

from __future__ import annotations

from typing import Any

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


def take_chunk_grammar(session: Any, update: Any) -> None:
    """After the fold of `update` into `session`: the session answers with the chunk's grammar.

    Called for every fold, including one the context-length guard refused (the session is then
    parked for its error and never runs again, so the grammar it holds is never used)."""
    from vllm.v1.request import RequestStatus

    if not hasattr(update, _CARRIES):
        return  # an update built before install_chunk_grammar_update: vLLM's own behaviour
    grammar = getattr(update, _CARRIES)
    session.structured_output_request = grammar
    if (
        grammar is not None
        and session.status == RequestStatus.WAITING
        and not grammar.is_grammar_ready
    ):
        session.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
