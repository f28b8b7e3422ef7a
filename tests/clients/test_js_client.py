"""The JS client's own unit tests (node --test, a fake WebSocket) and its type declarations."""

from __future__ import annotations

import subprocess

import pytest

from tests.clients.conftest import JS_DIR, need, need_tool


def test_js_unit_tests_pass_under_node_test_runner() -> None:
    node = need_tool("node", "install Node.js 20+")
    proc = subprocess.run(
        [node, "--test", "--test-reporter=spec", "test/"],
        cwd=JS_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "# fail 0" in proc.stdout or "fail 0" in proc.stdout, proc.stdout[-2000:]


@pytest.mark.slow  # tsc takes a few seconds
def test_typescript_declarations_compile() -> None:
    node = need_tool("node", "install Node.js 20+")
    tsc = JS_DIR / "node_modules" / "typescript" / "bin" / "tsc"
    need(tsc.is_file(), "typescript is not installed: npm ci --prefix clients/js")
    proc = subprocess.run(
        [node, str(tsc), "-p", "test/tsconfig.json"],
        cwd=JS_DIR,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
