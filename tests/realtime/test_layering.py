"""The session layer's pure parts import no vLLM: everything vLLM sits behind EngineSession."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REALTIME = Path(__file__).resolve().parents[2] / "realtime"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at the top or inside a function."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
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
