"""The wire protocol as one JSON Schema document: the source of every generated type.

``python -m vllm_realtime_protocol.schema`` prints it; ``make types`` writes it to
``clients/js/protocol.schema.json`` and compiles it to ``clients/js/protocol.d.ts`` (npm's
``json-schema-to-typescript``). ``tests/clients/test_types_drift.py`` fails when either file
differs from what the code gives, so nobody edits generated types by hand.

Client events and bodies are described as the server validates them; server events as the server
serializes them (every field present, defaults included).
"""

from __future__ import annotations

import json
from typing import Any, Final

from pydantic import TypeAdapter
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaMode

from vllm_realtime_protocol.constants import PROTOCOL_VERSION
from vllm_realtime_protocol.errors import ERROR_CLASSES
from vllm_realtime_protocol.events import (
    CLIENT_EVENT_ADAPTER,
    SERVER_EVENT_ADAPTER,
    ClientSecret,
    ClientSecretRequest,
)

_REF_PREFIX: Final = "#/$defs/"
SCHEMA_ID: Final = "https://github.com/vllm-realtime/vllm-realtime/protocol.schema.json"

# (name in $defs, mode, adapter): the roots; every model they reach lands in $defs by its name.
_ROOTS: Final[list[tuple[str, JsonSchemaMode, TypeAdapter[Any]]]] = [
    ("ClientEvent", "validation", CLIENT_EVENT_ADAPTER),
    ("ServerEvent", "serialization", SERVER_EVENT_ADAPTER),
    ("ClientSecretRequest", "validation", TypeAdapter(ClientSecretRequest)),
    ("ClientSecret", "serialization", TypeAdapter(ClientSecret)),
]


class _NoFieldTitles(GenerateJsonSchema):
    """Models keep their names; fields do not get pydantic's "Max Frame Bytes" titles, which a
    type generator would turn into one named alias per field."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


def _public_name(name: str) -> str:
    """pydantic names a client model whose echo differs "X-Input" / "X-Output": the client
    sends ``X``; the server echoes ``EffectiveX``, every default filled in."""
    if name.endswith("-Input"):
        return name.removesuffix("-Input")
    if name.endswith("-Output"):
        return "Effective" + name.removesuffix("-Output")
    return name


def _retarget(node: Any, names: dict[str, str]) -> Any:
    """``node`` with every ``#/$defs/<old>`` reference pointing at its new name."""
    if isinstance(node, list):
        return [_retarget(item, names) for item in node]
    if isinstance(node, dict):
        return {key: _retarget(value, names) for key, value in node.items()}
    if isinstance(node, str) and node.startswith(_REF_PREFIX):
        return _REF_PREFIX + names.get(
            node.removeprefix(_REF_PREFIX), node.removeprefix(_REF_PREFIX)
        )
    return node


def _renamed(defs: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    renamed = {}
    for name, schema in defs.items():
        new = _retarget(schema, names)
        if "title" in new:
            new["title"] = names[name]  # the name generated types take
        renamed[names[name]] = new
    return renamed


def wire_schema() -> dict[str, Any]:
    """One draft 2020-12 document: ``$defs`` holds every event and payload by its model name."""
    refs, top = TypeAdapter.json_schemas(
        [(name, mode, adapter) for name, mode, adapter in _ROOTS],
        ref_template="#/$defs/{model}",
        schema_generator=_NoFieldTitles,
    )
    defs: dict[str, Any] = dict(top["$defs"])
    for name, mode, _ in _ROOTS:
        root = refs[(name, mode)]
        if root.get("$ref") != f"#/$defs/{name}":
            defs[name] = root  # a union: named here, since it has no model of its own
    defs["ErrorCode"] = {
        "type": "string",
        "enum": sorted({cls.code for cls in ERROR_CLASSES}),
        "description": "Every error.code this protocol version sends (docs/protocol.md).",
    }
    defs["ErrorDetail"]["properties"]["code"] = {"$ref": "#/$defs/ErrorCode"}
    defs = _renamed(defs, {old: _public_name(old) for old in defs})
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "vllm-realtime wire protocol",
        "description": f"Protocol version {PROTOCOL_VERSION}; see docs/protocol.md.",
        "$defs": dict(sorted(defs.items())),
    }


def render() -> str:
    """The schema as committed: stable key order, two-space indent, a final newline."""
    return json.dumps(wire_schema(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    # `--tables`: the session's transition tables instead (tables.py; clients/js's
    # protocol.tables.json). They are printed from here because tables.py is imported with the
    # package, so `python -m` cannot run it as a fresh module.
    import sys

    from vllm_realtime_protocol import tables

    print(tables.render() if sys.argv[1:] == ["--tables"] else render(), end="")
