"""docs/protocol.md stays true: its examples parse, its tables match the code."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

import vllm_realtime_protocol.state
from vllm_realtime_protocol import ERROR_CLASSES, parse_client_event, parse_server_event
from vllm_realtime_protocol.events import CLIENT_EVENT_TYPES, SERVER_EVENT_TYPES

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text(encoding="utf-8")
JSON_BLOCKS = re.findall(r"```json\n(.*?)```", DOC, flags=re.S)


def test_doc_has_examples() -> None:
    assert len(JSON_BLOCKS) >= len(CLIENT_EVENT_TYPES) + len(SERVER_EVENT_TYPES)


@pytest.mark.parametrize("block", JSON_BLOCKS, ids=lambda b: str(json.loads(b)["type"]))
def test_json_examples_are_valid_events(block: str) -> None:
    event_type = json.loads(block)["type"]
    if event_type in CLIENT_EVENT_TYPES:
        assert parse_client_event(block).type == event_type
    else:
        ev = parse_server_event(block)
        assert ev.type == event_type
        # server examples show every field, as the server sends them
        assert set(json.loads(block)) == set(type(ev).model_fields)


def test_every_event_is_documented_with_an_example() -> None:
    shown = {json.loads(block)["type"] for block in JSON_BLOCKS}
    assert shown == set(CLIENT_EVENT_TYPES) | set(SERVER_EVENT_TYPES)
    for name in [*CLIENT_EVENT_TYPES, *SERVER_EVENT_TYPES]:
        assert f"### `{name}`" in DOC


def test_error_table_matches_the_code() -> None:
    rows = {
        m[0]: (m[1], m[2])
        for m in re.findall(r"^\| `([a-z_]+)` \| `([a-z_]+)` \| (yes|no) \|", DOC, flags=re.M)
    }
    assert rows == {
        cls.code: (cls.type, "yes" if cls.session_survives else "no") for cls in ERROR_CLASSES
    }


def test_state_diagram_matches_the_module_docstring() -> None:
    in_doc = re.search(r"## Session state.*?```\n(.*?)```", DOC, flags=re.S)
    assert in_doc is not None and vllm_realtime_protocol.state.__doc__ is not None
    in_module = vllm_realtime_protocol.state.__doc__.split("State diagram::", 1)[1].split(
        "The transitions", 1
    )[0]
    assert textwrap.dedent(in_doc.group(1)).strip() == textwrap.dedent(in_module).strip()


def test_no_query_string_auth() -> None:
    assert "`?api_key=` query parameter is not\naccepted" in DOC
    assert "vllm-realtime.auth.<key>" in DOC
