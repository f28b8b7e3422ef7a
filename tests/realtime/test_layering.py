"""The session layer's pure parts import no vLLM: everything vLLM sits behind EngineSession."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.python_source import parse

REALTIME = Path(__file__).resolve().parents[2] / "realtime"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function."""
    names: set[str] = set()
    for node in ast.walk(parse(path)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", ["hub.py", "admission.py", "prompt_format.py"])
def test_no_vllm_import(module: str) -> None:
    vllm = {
        name
        for name in imported_modules(REALTIME / module)
        if name.split(".")[0] == "vllm" or name.startswith("retention.vllm_adapter")
    }
    assert not vllm, f"realtime/{module} imports {sorted(vllm)}"


def test_the_hub_builds_no_sampling_params() -> None:
    """Sampling params, chunk prompts and token ids are the engine session's: the hub names
    none of them (one call per turn, `EngineSession.run_turn`)."""
    source = (REALTIME / "hub.py").read_text()
    for name in ("SamplingParams", "chunk_params", "render_chunk", "max_tokens =", "hf_config"):
        assert name not in source, f"realtime/hub.py names {name}"
    imported = imported_modules(REALTIME / "hub.py")
    assert "vllm.sampling_params" not in imported and "retention.policy" not in imported


def test_response_finished_is_called_from_the_session_layer_only() -> None:
    """The protocol machine's end of a turn is driven from one place, realtime/session.py."""
    callers = sorted(
        path.name
        for path in REALTIME.glob("*.py")
        if "response_finished(" in path.read_text() and path.name != "session.py"
    )
    assert not callers, f"response_finished is called from {callers}"


def test_the_connection_is_a_thin_transport() -> None:
    """`Connection` moves bytes and events: a handful of attributes (socket, session, hub, the
    server's shared objects, the resume hand-off), none of a session's state, no store method."""
    from realtime.config import ServerConfig
    from realtime.connection import Connection
    from vllm_realtime_protocol import Limits, SessionProtocol

    classes = [c for c in Connection.__mro__ if c is not object]
    assert all("__slots__" in vars(c) for c in classes), "an instance would get a __dict__"
    slots = [name for c in classes for name in vars(c)["__slots__"]]
    assert len(slots) <= 6, f"Connection has {len(slots)} attributes: {slots}"

    limits = Limits(server_version="0", model="m")
    hub = SimpleNamespace(config=ServerConfig(), new_protocol=lambda: SessionProtocol(limits))
    conn = Connection(SimpleNamespace(), hub, None)  # type: ignore[arg-type]
    assert not hasattr(conn, "__dict__")
    with pytest.raises(AttributeError):
        conn.turn = None  # type: ignore[attr-defined]

    words = ("store", "persist", "lease", "claim", "fence", "fold", "write")
    store_methods = [n for n in dir(Connection) if any(w in n.lower() for w in words)]
    assert not store_methods, f"Connection has store methods {store_methods}"


def test_every_transport_runs_a_turn_through_its_session() -> None:
    """WebSocket and HTTP sessions are one `Session` (machine, engine session, store writer):
    the hub's turn is entered from realtime/session.py only, and both transports hold one."""
    callers = sorted(
        path.name
        for path in REALTIME.glob("*.py")
        if "hub.run_turn(" in path.read_text() and path.name != "session.py"
    )
    assert not callers, f"the hub's run_turn is called from {callers}"
    for transport in ("connection.py", "http_api.py"):
        source = (REALTIME / transport).read_text()
        assert "realtime.session" in imported_modules(REALTIME / transport), transport
        assert "session.run_turn(" in source, transport
    # One call per turn from the transport: the fold, response.done and the error come with it.
    for name in ("store_turn(", "persist(", "persist_consolidated(", "response_finished("):
        assert name not in (REALTIME / "connection.py").read_text(), name
        assert name not in (REALTIME / "http_api.py").read_text(), name
