"""The server's end: graceful drain on SIGTERM/SIGINT, and engine processes that follow the
server's death (issue #20).

Two tests run `vllm-realtime serve` in its own process, as systemd or Kubernetes would, and check
the process table afterwards; the others drain an in-process server on the shared engine.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from tests.realtime.conftest import _serve, free_port, jpeg_bytes
from tests.reliability.conftest import (
    SUBPROTOCOLS,
    drain_until_closed,
    open_session,
    recv_until,
    wait_quiescent,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def image_event(seed: int, **extra: Any) -> str:
    return json.dumps(
        {"type": "frame.append", "image": base64.b64encode(jpeg_bytes(seed)).decode(), **extra}
    )


# -- the process table


def _ppid_and_cmdline(pid: int) -> tuple[int, str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":  # a zombie is gone but for its exit status
        return None
    return int(fields[1]), cmdline


def descendants(root: int) -> dict[int, str]:
    """Every live process below `root`: pid → command line (vLLM's are titled `VLLM::…`)."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (info := _ppid_and_cmdline(int(entry))) is not None:
            table[int(entry)] = info
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, cmdline) in table.items():
            if ppid == parent and pid not in found:
                found[pid] = cmdline
                frontier.append(pid)
    return found


def alive(pids: dict[int, str]) -> dict[int, str]:
    """Those of `pids` still running the same command (pids are not reused under our feet)."""
    out = {}
    for pid, cmdline in pids.items():
        info = _ppid_and_cmdline(pid)
        if info is not None and info[1] == cmdline:
            out[pid] = cmdline
    return out


class ServeProcess:
    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.url = f"ws://127.0.0.1:{self.port}/v1/realtime"
        self.http = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind", PYTHONPATH=str(ROOT))
        self.log = (ROOT / "artifacts").resolve()
        self.log.mkdir(exist_ok=True)
        self.stderr = open(self.log / f"serve-{self.port}.log", "w+")  # noqa: SIM115
        self.known: dict[int, str] = {}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "realtime.cli",
                "serve",
                "--port",
                str(self.port),
                "--kv-cache-memory-bytes",
                str(32 << 20),
                "--max-model-len",
                "1024",
                "--block-size",
                "32",
                "--dtype",
                "float32",
                # Lifecycle, not admission: compute admission measured on a loaded machine
                # refused these tests' sessions before the drain they test.
                "--compute-headroom",
                "0",
                # Lifecycle, not meaning: the random-weight VLM starts in seconds.
                *(() if "--model" in args else ("--model", "tiny-qwen2-vl")),
                *args,
            ],
            cwd=ROOT,
            env=env,
            stdout=self.stderr,  # vLLM logs to stdout
            stderr=subprocess.STDOUT,
        )

    def output(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-4000:]

    async def wait_healthy(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient() as client:
            while True:
                assert self.proc.poll() is None, self.output()
                try:
                    if (await client.get(f"{self.http}/health")).status_code == 200:
                        # Remembered: once the server is gone they are no longer below it.
                        self.known = descendants(self.proc.pid)
                        return
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "server did not start"
                await asyncio.sleep(0.5)

    def stop(self) -> None:
        """Whatever happened, leave nothing running: the server, then its engine processes."""
        procs = {**self.known, **descendants(self.proc.pid)}
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in alive(procs):
            os.kill(pid, signal.SIGKILL)
        self.stderr.close()


@pytest.fixture
def serve_process() -> Iterator[list[ServeProcess]]:
    started: list[ServeProcess] = []
    yield started
    for p in started:
        p.stop()


def engine_processes(server_pid: int) -> dict[int, str]:
    procs = descendants(server_pid)
    engines = {pid: cmd for pid, cmd in procs.items() if cmd.startswith("VLLM::")}
    assert engines, f"no VLLM:: process below the server: {procs}"
    return procs


@pytest.mark.parametrize("sig", [signal.SIGTERM])
async def test_sigterm_drains_four_sessions_and_exits_0(
    serve_process: list[ServeProcess], sig: signal.Signals
) -> None:
    srv = ServeProcess("--drain-timeout", "60")
    serve_process.append(srv)
    await srv.wait_healthy()
    procs = engine_processes(srv.proc.pid)

    sockets = [await websockets.connect(srv.url, subprotocols=SUBPROTOCOLS) for _ in range(4)]
    for ws in sockets:
        await open_session(ws, sampling={"max_tokens": 96})
    # Two sessions have a reply in flight at the signal, two are idle.
    for i, ws in enumerate(sockets[:2]):
        await ws.send(image_event(i, frame_id=f"busy-{i}"))
        await recv_until(ws, "response.created")
    signalled = time.monotonic()
    srv.proc.send_signal(sig)
    events = await asyncio.gather(*(drain_until_closed(ws, timeout=120) for ws in sockets))
    closed_after = time.monotonic() - signalled
    status = await asyncio.to_thread(srv.proc.wait, 120)
    exited_after = time.monotonic() - signalled

    for i, seen in enumerate(events):
        kinds = [e["type"] for e in seen]
        assert "server.draining" in kinds, (i, kinds)
        draining = seen[kinds.index("server.draining")]
        assert 0 < draining["seconds_left"] <= 60
        assert kinds[-1] == "session.closed", (i, kinds)
        assert seen[-1]["reason"] == "server_shutdown"
        assert kinds.index("server.draining") < kinds.index("session.closed")
        if i < 2:
            # The reply in flight was let finish: completed or cut by max_tokens, not cancelled.
            done = [e for e in seen if e["type"] == "response.done"]
            assert len(done) == 1 and done[0]["frame_id"] == f"busy-{i}", seen
            assert done[0]["status"] in ("completed", "incomplete"), done
            assert kinds.index("response.done") < kinds.index("session.closed")
        else:
            assert "response.done" not in kinds
    assert status == 0, srv.output()
    engines = {pid: cmd for pid, cmd in procs.items() if cmd.startswith("VLLM::")}
    assert alive(engines) == {}, f"left running: {alive(engines)}"
    # multiprocessing's resource tracker ends once every process holding its pipe is gone.
    for _ in range(100):
        if not alive(procs):
            break
        await asyncio.sleep(0.05)
    assert alive(procs) == {}, f"left running: {alive(procs)}"
    out = srv.output()
    assert "drain finished" in out and "Traceback" not in out, out
    print(
        f"\nSIGTERM: sessions closed {closed_after:.2f} s after the signal, "
        f"exit 0 after {exited_after:.2f} s; {len(procs)} child processes gone"
    )


async def test_sigkill_engine_processes_follow_within_10s(
    serve_process: list[ServeProcess],
) -> None:
    srv = ServeProcess()
    serve_process.append(srv)
    await srv.wait_healthy()
    procs = engine_processes(srv.proc.pid)
    killed = time.monotonic()
    srv.proc.kill()
    srv.proc.wait()
    while alive(procs) and time.monotonic() - killed < 30:
        await asyncio.sleep(0.05)
    gone_after = time.monotonic() - killed
    assert alive(procs) == {}, f"still running 30 s after SIGKILL: {alive(procs)}"
    assert gone_after < 10, gone_after
    print(f"\nSIGKILL: {len(procs)} engine processes gone {gone_after:.2f} s after the kill")


# -- the drain itself, in-process on the shared engine


async def test_drain_lets_replies_finish_and_frees_every_block(vlm_engine: object) -> None:
    async for srv in _serve(vlm_engine, None, max_sessions=4, drain_timeout_s=60.0):
        before = await wait_quiescent(srv)
        busy = await websockets.connect(srv.url, subprotocols=SUBPROTOCOLS)
        idle = await websockets.connect(srv.url, subprotocols=SUBPROTOCOLS)
        await open_session(busy, sampling={"max_tokens": 64})
        await open_session(idle)
        await busy.send(image_event(1, frame_id="f0"))
        await recv_until(busy, "response.created")
        drain = asyncio.create_task(srv.app.state.drain())  # type: ignore[attr-defined]
        idle_seen = await drain_until_closed(idle)
        assert [e["type"] for e in idle_seen] == ["server.draining", "session.closed"]
        async with httpx.AsyncClient() as client:
            health = await client.get(f"{srv.http}/health")
            assert health.status_code == 503 and health.json()["status"] == "draining"
            refused = await client.post(f"{srv.http}/v1/streaming/sessions", json={})
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "capacity_exceeded"
        # A connection made during the drain is told at once.
        late = await websockets.connect(srv.url, subprotocols=SUBPROTOCOLS)
        late_seen = await drain_until_closed(late)
        assert [e["type"] for e in late_seen] == [
            "session.created",
            "server.draining",
            "session.closed",
        ]
        busy_seen = await drain_until_closed(busy)
        kinds = [e["type"] for e in busy_seen]
        done = busy_seen[kinds.index("response.done")]
        assert done["status"] in ("completed", "incomplete"), done
        assert kinds.index("server.draining") < kinds.index("response.done")
        assert kinds[-1] == "session.closed" and busy_seen[-1]["reason"] == "server_shutdown"
        await asyncio.wait_for(drain, 30)
        assert await wait_quiescent(srv) == before


async def test_drain_deadline_cancels_the_reply_in_flight(vlm_engine: object) -> None:
    async for srv in _serve(vlm_engine, None, max_sessions=4, drain_timeout_s=0.0):
        before = await wait_quiescent(srv)
        ws = await websockets.connect(srv.url, subprotocols=SUBPROTOCOLS)
        await open_session(ws, sampling={"max_tokens": 256})
        await ws.send(image_event(2, frame_id="f0"))
        await recv_until(ws, "response.text.delta")
        await asyncio.wait_for(srv.app.state.drain(), 30)  # type: ignore[attr-defined]
        seen = await drain_until_closed(ws)
        kinds = [e["type"] for e in seen]
        assert kinds[0] == "server.draining" and seen[0]["seconds_left"] == 0
        done = seen[kinds.index("response.done")]
        assert (done["status"], done["status_reason"]) == ("cancelled", "server_shutdown")
        assert kinds[-1] == "session.closed" and seen[-1]["reason"] == "server_shutdown"
        assert await wait_quiescent(srv) == before
