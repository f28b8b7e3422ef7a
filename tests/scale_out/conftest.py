"""A real redis-server per test module (Debian's `redis-server`, scripts/setup.sh installs it):
a random loopback port, a temporary directory, no persistence. Missing binary: a skip outside
CI, a failure in CI (the store's tests must run there)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_binary() -> str | None:
    found = shutil.which("redis-server")
    if found is None and Path("/usr/bin/redis-server").exists():
        found = "/usr/bin/redis-server"
    return found


def start_redis(tmp: Path, port: int | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """A redis-server in `tmp` on `port` (None: a free one); a dump.rdb there is loaded."""
    binary = redis_binary()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is missing in CI (scripts/setup.sh installs it)")
        pytest.skip("redis-server is not installed (scripts/setup.sh installs Debian's)")
    port = port or free_port()
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(tmp),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
        ],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"redis://127.0.0.1:{port}/0"
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not start")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, str]]:
    """The module's redis-server process (a test may stop it) and its URL."""
    proc, url = start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def redis_url(redis_server: tuple[Any, str]) -> str:
    return redis_server[1]


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[Any]:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()
