"""The webcam script through outages (issue #20), against the real server on ffmpeg's testsrc:
a network drop (a TCP proxy cuts every connection) resumes the same session, and a server
restart (drain, stop, a new server on the same port) moves to a new session."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json

import pytest

from tests.clients.conftest import need_tool, webcam
from tests.realtime.conftest import _serve, free_port
from tests.scale_out.conftest import Proxy

pytestmark = pytest.mark.slow


async def wait_for(condition, timeout: float = 120) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")


async def test_webcam_resumes_after_a_drop_and_survives_a_restart(vlm_engine: object) -> None:
    need_tool("ffmpeg", "apt-get install ffmpeg")
    port = free_port()
    first = _serve(vlm_engine, None, port=port, max_sessions=4, drain_timeout_s=30.0)
    srv = await first.__anext__()
    proxy = Proxy(port)
    await proxy.start()
    args = webcam.parse_args(
        [
            "--source", "testsrc", "--fps", "5", "--size", "112x112", "--max-tokens", "4",
            "--max-frames", "14", "--url", f"ws://127.0.0.1:{proxy.port}/v1/realtime",
            "--retries", "20", "--json",
        ]
    )  # fmt: skip
    out, err = io.StringIO(), io.StringIO()
    run = asyncio.create_task(webcam.run(args, out, err, handle_signals=False))
    second = None
    try:
        frames = srv.hub.metrics.frames
        await wait_for(lambda: frames._value.get() >= 3)
        proxy.cut()  # the network drops
        await wait_for(lambda: srv.hub.metrics.sessions_resumed._value.get() >= 1)
        at_resume = frames._value.get()
        await wait_for(lambda: frames._value.get() >= at_resume + 2)
        # A restart: the server drains and stops, a new one comes up on the same port.
        await asyncio.wait_for(srv.app.state.drain(), 60)  # type: ignore[attr-defined]
        with pytest.raises(StopAsyncIteration):
            await first.__anext__()
        second = _serve(vlm_engine, None, port=port, max_sessions=4)
        srv2 = await second.__anext__()
        rc = await asyncio.wait_for(run, 240)
        assert rc == 0, err.getvalue()
        summary = json.loads(out.getvalue().splitlines()[-1])
        assert summary["replies"] == 14, summary
        assert summary["resumes"] >= 1 and summary["sessions"] >= 2, summary
        assert srv2.hub.metrics.frames._value.get() >= 1
        log = err.getvalue()
        assert "session resumed" in log and "new session" in log, log
    finally:
        if not run.done():
            run.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await run
        await proxy.stop()
        if second is not None:
            with contextlib.suppress(StopAsyncIteration):
                await second.__anext__()
