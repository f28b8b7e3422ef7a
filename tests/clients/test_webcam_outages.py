"""The webcam script through outages (issue #20), against the real server on ffmpeg's testsrc:
a network drop (a TCP proxy cuts every connection) resumes the same session, and a server
restart (drain, stop, a new server on the same port) moves to a new session."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json

import pytest

from tests.clients.conftest import need_tool
from tests.clients.test_webcam import webcam
from tests.realtime.conftest import _serve, free_port

pytestmark = pytest.mark.slow


class Proxy:
    """A TCP forwarder whose `cut()` drops every connection through it, like a network would."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.server: asyncio.Server | None = None
        self.pipes: set[asyncio.StreamWriter] = set()
        self.cuts = 0

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        self.pipes |= {writer, up_writer}

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(1 << 16):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
        self.pipes -= {writer, up_writer}

    def cut(self) -> None:
        self.cuts += 1
        for writer in list(self.pipes):
            writer.transport.abort()
        self.pipes.clear()

    async def stop(self) -> None:
        self.cut()
        if self.server is not None:
            self.server.close()


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
