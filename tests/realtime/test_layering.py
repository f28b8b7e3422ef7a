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
