"""The generated wire types stay what protocol/ gives: `make types` regenerates them.

protocol.schema.json is pydantic's JSON Schema of every event; protocol.d.ts is compiled from it
by npm's json-schema-to-typescript. protocol.tables.json is the session's transition tables
(tables.py), and realtime-client.js carries a copy of it, which its ClientMachine runs on. A
change to protocol/ without `make types` fails here, and so does a hand edit of
any of them. The JS machine's replay fixture (clients/js/test/machine-sequences.json) stays
what the Python machine gives.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.clients import machine_sequences
from tests.clients.conftest import JS_DIR, need, need_tool
from vllm_realtime_protocol import tables
from vllm_realtime_protocol.events import CLIENT_EVENT_TYPES, SERVER_EVENT_TYPES
from vllm_realtime_protocol.schema import render, wire_schema

SCHEMA_FILE = JS_DIR / "protocol.schema.json"
TYPES_FILE = JS_DIR / "protocol.d.ts"
TABLES_FILE = JS_DIR / "protocol.tables.json"
CLIENT_FILE = JS_DIR / "realtime-client.js"
SEQUENCES_FILE = JS_DIR / "test" / "machine-sequences.json"
REGENERATE = "run `make types` and commit the result"


def test_committed_schema_is_what_the_protocol_gives() -> None:
    assert SCHEMA_FILE.read_text(encoding="utf-8") == render(), REGENERATE


def test_schema_names_every_event_once() -> None:
    defs = wire_schema()["$defs"]
    client = defs["ClientEvent"]["discriminator"]["mapping"]
    server = defs["ServerEvent"]["discriminator"]["mapping"]
    assert set(client) == set(CLIENT_EVENT_TYPES)
    assert set(server) == set(SERVER_EVENT_TYPES)
    # A config the client sends and the server's echo of it (defaults filled) are two types.
    assert {"SessionConfig", "EffectiveSessionConfig"} <= set(defs)
    assert set(defs["EffectiveSessionConfig"]["required"]) == set(
        defs["EffectiveSessionConfig"]["properties"]
    )
    # Server events list every field as present: the server always sends them.
    opened = defs["SessionOpenedEvent"]
    assert set(opened["required"]) == set(opened["properties"])


def test_error_codes_are_an_enum_of_the_codes_the_server_sends() -> None:
    from vllm_realtime_protocol import ERROR_CLASSES

    codes = wire_schema()["$defs"]["ErrorCode"]["enum"]
    assert codes == sorted({cls.code for cls in ERROR_CLASSES})
    assert "invalid_request" in codes


@pytest.mark.slow  # node + the generator: a few seconds
def test_committed_typescript_is_what_the_schema_compiles_to(tmp_path: Path) -> None:
    node = need_tool("node", "install Node.js 20+")
    generator = JS_DIR / "node_modules" / "json-schema-to-typescript"
    need(
        generator.is_dir(), "json-schema-to-typescript is not installed: npm ci --prefix clients/js"
    )
    schema = tmp_path / "protocol.schema.json"
    schema.write_text(render(), encoding="utf-8")
    out = tmp_path / "protocol.d.ts"
    proc = subprocess.run(
        [node, "scripts/gen-types.mjs", str(schema), str(out)],
        cwd=JS_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.read_text(encoding="utf-8") == TYPES_FILE.read_text(encoding="utf-8"), REGENERATE


def test_the_package_ships_the_generated_types() -> None:
    package = json.loads((JS_DIR / "package.json").read_text(encoding="utf-8"))
    assert {"protocol.d.ts", "protocol.schema.json", "protocol.tables.json"} <= set(
        package["files"]
    )


def test_committed_tables_are_what_the_protocol_gives() -> None:
    assert TABLES_FILE.read_text(encoding="utf-8") == tables.render(), REGENERATE
    assert json.loads(TABLES_FILE.read_text(encoding="utf-8")) == tables.as_data()


def test_the_js_client_runs_on_the_committed_tables() -> None:
    """realtime-client.js's copy (between its BEGIN/END lines, written by
    scripts/embed-tables.mjs) is protocol.tables.json, byte for byte."""
    client = CLIENT_FILE.read_text(encoding="utf-8")
    begin, end = "// BEGIN protocol.tables.json\n", "// END protocol.tables.json\n"
    assert client.count(begin) == client.count(end) == 1
    block = client[client.index(begin) + len(begin) : client.index(end)]
    assert block == f"export const PROTOCOL_TABLES = {tables.render().rstrip()};\n", REGENERATE
    assert "new ClientMachine()" in client  # and the client makes its machines of them


def test_the_js_machines_fixture_is_what_the_python_machine_gives() -> None:
    """The sequences clients/js/test/client-machine.test.mjs replays, with the Python
    ClientProtocol's state after each step; regenerating also checks that the Python client
    and server machines agree after every delivery of 80 seeded sequences."""
    assert SEQUENCES_FILE.read_text(encoding="utf-8") == machine_sequences.render(), (
        "run `python -m tests.clients.machine_sequences > clients/js/test/machine-sequences.json`"
    )


def test_the_pages_tuned_replies_are_what_the_model_was_tuned_on() -> None:
    """realtime/static/tuned-replies.json (the page's default response_format per model) is
    training/page_formats.py's, which bench/vlm_fidelity.py's robust mode also sends."""
    from bench.vlm_fidelity import reply_format
    from training.page_formats import describe_format, render

    committed = Path(__file__).resolve().parents[2] / "realtime" / "static" / "tuned-replies.json"
    assert committed.read_text(encoding="utf-8") == render(), REGENERATE
    assert json.loads(render())["smol-qwen2-vl"] == reply_format("describe")["response_format"]
    sentences = describe_format()["json_schema"]["schema"]["enum"]
    assert "A yellow circle on a green background." in sentences and len(sentences) == 378
