"""External tools a test needs (hadolint, nginx, ffmpeg, node, chromium): skip where one is
missing on a developer's machine, fail in CI. And `vllm-realtime serve` itself, run as a user
runs it (`served`).

CI is told apart by the environment: `CI` set (what hosted runners set; `.ci/run` sets it too),
so a CI image that lost a tool turns red instead of skipping silently.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

SERVE = Path(sys.executable).parent / "vllm-realtime"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def need(ok: bool, what: str) -> None:
    """Skip when a tool is missing, saying how to get it; in CI (.ci/run installs them) fail."""
    if ok:
        return
    if in_ci():
        pytest.fail(f"{what} (CI installs it in .ci/run)")
    pytest.skip(what)


def need_tool(name: str, install: str) -> str:
    """The path of an executable, or skip (fail in CI) saying how to install it."""
    path = shutil.which(name)
    need(path is not None, f"{name} is not installed: {install}")
    assert path is not None
    return path


@contextlib.asynccontextmanager
async def served(*args: str, start_timeout_s: float = 300) -> AsyncIterator[int]:
    """`vllm-realtime serve --port PORT ARGS...` (the console script, its own engine), up once
    `/health` answers 200; yields PORT. On exit, SIGINT, which drains and must exit 0
    (realtime/drain.py); its stderr is in the assertion when it does not."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind")
    # A file, not a pipe: nobody reads a pipe while the server runs, and a full one blocks it.
    with tempfile.TemporaryFile("w+") as stderr:

        def tail() -> str:
            stderr.seek(0)
            return stderr.read()[-3000:]

        proc = subprocess.Popen(
            [str(SERVE), "serve", "--port", str(port), *args],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            text=True,
        )
        try:
            deadline = time.monotonic() + start_timeout_s
            async with httpx.AsyncClient() as client:
                while True:
                    assert proc.poll() is None, tail()
                    with contextlib.suppress(httpx.TransportError):
                        if (await client.get(f"http://127.0.0.1:{port}/health")).status_code == 200:
                            break
                    assert time.monotonic() < deadline, f"server did not start: {tail()}"
                    await asyncio.sleep(0.5)
            yield port
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, tail()
