"""Fixtures and helpers of the reliability and security tests.

The shared engines (`vlm_engine`, `smollm2_engine`, tests/conftest.py) are reused; the servers
here are cheap uvicorn instances on them with the limits a test needs. The shared servers of
tests/realtime/conftest.py are re-exported so that the same configurations are exercised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from retention.vllm_adapter.introspect import kv_stats
from tests.realtime.conftest import (
    SUBPROTOCOLS,
    RunningServer,
    _serve,
    open_session,
    recv,
    recv_until,
    server,
    text_server,
)

__all__ = ["SUBPROTOCOLS", "open_session", "recv", "recv_until", "server", "text_server"]


async def drain_until_closed(ws: Any, timeout: float = 60) -> list[dict[str, Any]]:
    """Every event up to the server closing the socket."""
    import websockets

    seen: list[dict[str, Any]] = []
    with contextlib.suppress(websockets.exceptions.ConnectionClosed):
        while True:
            seen.append(await recv(ws, timeout))
    return seen


async def free_blocks(srv: RunningServer) -> int:
    return int((await kv_stats(srv.hub.engine))["num_free_blocks"])


async def wait_quiescent(srv: RunningServer, timeout: float = 30) -> int:
    """Wait until this server has no session and the engine's whole pool is free; the count."""
    stats: dict[str, Any] = {}
    for _ in range(int(timeout / 0.05)):
        stats = await kv_stats(srv.hub.engine)
        if stats["num_free_blocks"] == stats["num_usable_blocks"] and not srv.hub.sessions:
            return int(stats["num_free_blocks"])
        await asyncio.sleep(0.05)
    held = {k: v for k, v in stats.get("blocks_by_request", {}).items() if v}
    raise AssertionError(
        f"not quiescent after {timeout}s: free {stats.get('num_free_blocks')} of "
        f"{stats.get('num_usable_blocks')}, sessions {list(srv.hub.sessions)}, held {held}"
    )


class LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self) -> str:
        formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
        return "\n".join(formatter.format(r) for r in self.records)

    def failures(self) -> list[logging.LogRecord]:
        """Records that mean a server-side exception: ERROR and up, or with a traceback."""
        return [r for r in self.records if r.levelno >= logging.ERROR or r.exc_info]


SERVER_LOGGERS = ("", "uvicorn", "uvicorn.error", "uvicorn.access", "vllm_realtime", "asyncio")


@contextlib.contextmanager
def capture_logs(
    names: tuple[str, ...] = SERVER_LOGGERS, level: int = logging.DEBUG
) -> Iterator[LogCapture]:
    """Attach one handler to `names` (directly: uvicorn's loggers do not propagate)."""
    handler = LogCapture()
    saved: list[tuple[logging.Logger, int]] = []
    for name in names:
        logger = logging.getLogger(name)
        saved.append((logger, logger.level))
        logger.setLevel(level)
        logger.addHandler(handler)
    try:
        yield handler
    finally:
        for logger, old in saved:
            logger.removeHandler(handler)
            logger.setLevel(old)


@pytest.fixture(scope="session")
async def idle_server(vlm_engine: object) -> AsyncIterator[RunningServer]:
    async for s in _serve(vlm_engine, None, max_sessions=4, idle_timeout_s=1.0):
        yield s


@pytest.fixture(scope="session")
async def slots_server(vlm_engine: object) -> AsyncIterator[RunningServer]:
    """More max_sessions than the shared engine has request slots (max_num_seqs=16)."""
    async for s in _serve(vlm_engine, None, max_sessions=40, idle_timeout_s=60.0):
        yield s


@pytest.fixture(scope="session")
async def two_key_server(vlm_engine: object) -> AsyncIterator[RunningServer]:
    async for s in _serve(
        vlm_engine,
        "key-a",
        api_keys=("key-b",),
        max_sessions=6,
        max_sessions_per_key=2,
        max_frame_bytes=1 << 20,
    ):
        yield s


@pytest.fixture(scope="session")
async def rate_server(vlm_engine: object) -> AsyncIterator[RunningServer]:
    async for s in _serve(vlm_engine, None, max_sessions=2, max_frames_per_s=2.0, frame_burst=3):
        yield s
