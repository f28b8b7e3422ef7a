"""Structured replies: OpenAI's ``response_format`` turned into vLLM structured outputs.

Theory of operation: a reply format is checked once, when the client names it (session.open for
the session's format, the chunk's own turn for a per-chunk override), and becomes
`StructuredOutputsParams` on that chunk's `SamplingParams` (`engine_session.structured_outputs`:
this module checks formats without importing vLLM). vLLM 0.32 does not carry a chunk's
grammar into a streaming-input session by itself; `retention/vllm_adapter/chunk_grammar.py` does.
The backend is vLLM's "auto" choice; on the CPU build that is xgrammar.
"""

from __future__ import annotations

import json

from vllm_realtime_protocol import InvalidRequestError, JsonSchemaFormat, ResponseFormat
from vllm_realtime_protocol.errors import truncate


def check_response_format(fmt: ResponseFormat | None, where: str) -> None:
    """Refuse a schema that is not a valid JSON Schema, with `invalid_request`."""
    if not isinstance(fmt, JsonSchemaFormat):
        return
    import jsonschema

    schema = fmt.json_schema.schema_
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        path = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise InvalidRequestError(
            f"{where}.json_schema.schema is not a valid JSON Schema at {truncate(path, 60)}: "
            f"{truncate(exc.message, 160)}"
        ) from None
    try:
        json.dumps(schema)
    except (TypeError, ValueError):  # pragma: no cover (it came from JSON)
        raise InvalidRequestError(f"{where}.json_schema.schema is not JSON") from None


def compile_check(fmt: ResponseFormat | None, where: str) -> None:
    """Ask the grammar backend whether it can compile the format (xgrammar, as vLLM's "auto"
    picks first); a schema xgrammar refuses is refused here rather than at the first chunk."""
    if not isinstance(fmt, JsonSchemaFormat):
        return
    try:
        import xgrammar
    except ImportError:  # pragma: no cover (another backend: vLLM checks at the first chunk)
        return
    try:
        xgrammar.Grammar.from_json_schema(json.dumps(fmt.json_schema.schema_))
    except Exception as exc:
        raise InvalidRequestError(
            f"{where}.json_schema.schema cannot be compiled to a grammar: {truncate(str(exc), 160)}"
        ) from None


def validate_format(fmt: ResponseFormat | None, where: str) -> None:
    """Both checks: a valid JSON Schema that the grammar backend compiles."""
    check_response_format(fmt, where)
    compile_check(fmt, where)
