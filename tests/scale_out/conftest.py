"""A real redis-server per test module (Debian's `redis-server`, scripts/setup.sh installs it):
a random loopback port, a temporary directory, no persistence. Missing binary: a skip outside
CI, a failure in CI (the store's tests must run there).

Also what the scale-out tests share: `vllm-realtime serve` replicas on that store (`Replica`,
`start_replica`, `replica_pair`), the text and camera openings and turns they drive, and
`Proxy`, a TCP forwarder that stands in for a router (retargeted) or a network (cut)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets

from tests.realtime.conftest import camera_jpeg


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


class RestartableRedis:
    """redis-server on a fixed port and directory, which a test stops and starts again (with
    its data, or without: a restart that lost everything), or hangs."""

    def __init__(self, tmp: Path) -> None:
        self.dir, self.port = tmp, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc, url = start_redis(self.dir, self.port)
        assert url == self.url

    def hang(self, hung: bool) -> None:
        """SIGSTOP (it accepts connections and answers nothing) or SIGCONT."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP if hung else signal.SIGCONT)

    def stop(self, *, keep_data: bool) -> None:
        """Kill it (no goodbye, no save at shutdown); `keep_data`: SAVE first, so the next
        start loads what it held."""
        assert self.proc is not None
        if keep_data:
            import redis as sync_redis

            with sync_redis.Redis(port=self.port) as client:
                client.save()
        else:
            (self.dir / "dump.rdb").unlink(missing_ok=True)
        self.proc.kill()
        self.proc.wait(timeout=10)
        if not keep_data:
            (self.dir / "dump.rdb").unlink(missing_ok=True)


@pytest.fixture(scope="module")
def restartable_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RestartableRedis]:
    """A module's redis-server that its tests may stop and start again. A module that uses it
    names it as its `redis_url` too (`redis_url = restartable_redis_url`), so `redis_client`
    and the replicas reach it."""
    server = RestartableRedis(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.terminate()
            server.proc.wait(timeout=10)


@contextlib.contextmanager
def nginx_router(logdir: Path, ports: list[int]) -> Iterator[str]:
    """Debian's nginx with the shipped router config (docker/nginx/realtime.conf) over the
    replicas on `ports`; its WebSocket URL. Missing nginx: a skip outside CI, a failure in CI."""
    from bench.scale_out_check import nginx_binary, start_nginx
    from tests.tools import need

    nginx = nginx_binary()
    need(nginx is not None, "nginx is not installed: apt-get install nginx-light")
    assert nginx is not None
    listen = free_port()
    proc = start_nginx(nginx, logdir, listen, ports)
    try:
        yield f"ws://127.0.0.1:{listen}/v1/realtime"
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[Any]:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


ROOT = Path(__file__).resolve().parents[2]


REPLICA_ARGS = [
    "--model",
    "smollm2-135m-instruct",
    "--kv-cache-memory-bytes",
    str(96 << 20),
    "--max-model-len",
    "1024",
    "--block-size",
    "32",
    "--dtype",
    "float32",
    "--max-num-seqs",
    "8",
    "--api-key",
    "key-a",
    "--api-key",
    "key-b",
    "--max-resume-grace",
    "60",
]


OPEN = {
    "type": "session.open",
    "modality": "text",
    "instructions": "You are a helpful assistant. Answer in one short sentence.",
    "retention": {"sink_chunks": 1, "window_chunks": 6},
    "limits": {"max_chunk_tokens": 48},
    "sampling": {"max_tokens": 24, "temperature": 0.0},
    "resumable": {"grace_s": 30},
}


FACT = "Remember this: my dog's name is Biscuit."


QUESTION = "What is my dog's name?"


class Replica:
    def __init__(self, port: int, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.port, self.proc, self.log = port, proc, log
        self.url = f"ws://127.0.0.1:{port}/v1/realtime"

    def kill(self) -> None:
        """SIGKILL the whole replica: server, EngineCore and worker (its process group)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of its group is left
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def start_replica(
    redis_url: str, logdir: Path, name: str, args: list[str] | None = None, port: int = 0
) -> Replica:
    """A replica on `port` (0: a free one; a router's config names a fixed one)."""
    port = port or free_port()
    log = logdir / f"{name}.log"
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "realtime.cli", "serve", "--port", str(port)]
    proc = subprocess.Popen(
        [*cmd, "--session-store", redis_url, *(REPLICA_ARGS if args is None else args)],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
        cwd=ROOT,
        start_new_session=True,  # its own process group: a kill takes the engine with it
    )
    return Replica(port, proc, log)


def wait_healthy(replica: Replica, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if replica.proc.poll() is not None:
            raise RuntimeError(f"replica exited: {replica.log.read_text()[-3000:]}")
        health = f"http://127.0.0.1:{replica.port}/health"
        with contextlib.suppress(OSError), urllib.request.urlopen(health, timeout=2):
            return
        time.sleep(1)
    raise TimeoutError(replica.log.read_text()[-3000:])


@contextlib.contextmanager
def replica_pair(
    redis_url: str, logdir: Path, names: tuple[str, str], args: list[str] | None = None
) -> Iterator[list[Replica]]:
    """Two healthy replicas sharing the store; stopped (with their engines) on the way out."""
    reps = [start_replica(redis_url, logdir, name, args) for name in names]
    try:
        for r in reps:
            wait_healthy(r)
        yield reps
    finally:
        for r in reps:
            r.stop()


# What the running test opened: its sockets, and each session's replica and resume token.
_SOCKETS: list[Any] = []
_SESSIONS: dict[str, tuple[Replica, str]] = {}


async def _end(ws: Any) -> None:
    with contextlib.suppress(Exception):
        await ws.send(json.dumps({"type": "session.close"}))
        await recv_type(ws, "session.closed", "error", timeout=10)
    with contextlib.suppress(Exception):
        await ws.close()


@pytest.fixture(autouse=True)
async def _close_what_the_test_left() -> AsyncIterator[None]:
    """A failed test's sockets live on in its traceback, and a session whose socket it dropped
    stays parked for its resume grace, holding its KV reservation: the module's next tests were
    then refused admission. Each session the test left is closed (a parked one resumed first),
    so one failure stays one failure."""
    yield
    for _ in range(2):  # the sockets the test left, then those that resumed its parked sessions
        while _SOCKETS:
            await _end(_SOCKETS.pop())
        parked = list(_SESSIONS.items())
        _SESSIONS.clear()
        for session_id, (replica, token) in parked:
            with contextlib.suppress(Exception):
                await resume(replica, session_id, token)  # session_not_found: it was closed


async def connect(replica: Replica, key: str = "key-a") -> Any:
    ws = await websockets.connect(
        replica.url,
        subprotocols=["vllm-realtime"],  # type: ignore[list-item]
        additional_headers={"Authorization": f"Bearer {key}"},
        max_size=None,
    )
    _SOCKETS.append(ws)
    created = json.loads(await ws.recv())
    assert created["type"] == "session.created"
    return ws


async def recv_type(ws: Any, *types: str, timeout: float = 180) -> dict[str, Any]:
    while True:
        event = json.loads(await asyncio.wait_for(ws.recv(), timeout))
        if event["type"] in types:
            return event


async def open_session(
    replica: Replica, opening: dict[str, Any] = OPEN, **extra: Any
) -> tuple[Any, str, str]:
    ws = await connect(replica)
    await ws.send(json.dumps({**opening, **extra}))
    opened = await recv_type(ws, "session.opened", "error")
    assert opened["type"] == "session.opened", opened
    _SESSIONS[opened["session_id"]] = (replica, opened["resume_token"])
    return ws, opened["session_id"], opened["resume_token"]


async def say(ws: Any, text: str) -> dict[str, Any]:
    """One answered text turn; its response.done."""
    await ws.send(json.dumps({"type": "frame.append", "text": text}))
    done = await recv_type(ws, "response.done", "error")
    assert done["type"] == "response.done" and done["status"] == "completed", done
    return done


async def resume(replica: Replica, session_id: str, token: str, key: str = "key-a") -> Any:
    ws = await connect(replica, key)
    await ws.send(
        json.dumps({"type": "session.resume", "session_id": session_id, "resume_token": token})
    )
    answer = await recv_type(ws, "session.resumed", "error")
    if answer["type"] == "session.resumed":
        _SESSIONS[session_id] = (replica, answer["resume_token"])
    return ws, answer


async def events_until_closed(ws: Any, timeout: float = 60) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    with contextlib.suppress(websockets.ConnectionClosed):
        while True:
            seen.append(json.loads(await asyncio.wait_for(ws.recv(), timeout)))
    return seen


async def close(ws: Any) -> None:
    """Close the session (a dropped socket would park it, and keep it in the store)."""
    await ws.send(json.dumps({"type": "session.close"}))
    await recv_type(ws, "session.closed")
    await ws.close()


def not_found(event: dict[str, Any]) -> bool:
    return event["type"] == "error" and event["error"]["code"] == "session_not_found"


def sessions_on(replica: Replica) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{replica.port}/health", timeout=5) as resp:
        return int(json.loads(resp.read())["sessions"])


VIDEO_ARGS = [
    "--model",
    "smol-qwen2-vl",
    "--kv-cache-memory-bytes",
    str(128 << 20),
    "--max-model-len",
    "1024",
    "--block-size",
    "32",
    "--dtype",
    "float32",
    "--max-num-seqs",
    "8",
    "--api-key",
    "key-a",
    "--max-resume-grace",
    "60",
]


# A camera session with the default retention (sink 1 chunk, window 8 chunks).
OPEN_VIDEO = {
    "type": "session.open",
    "modality": "video",
    "instructions": "Name the colours you see.",
    "sampling": {"max_tokens": 16, "temperature": 0.0},
    "resumable": {"grace_s": 30},
}


async def show(ws: Any, i: int, prompt: str = "What colour?") -> dict[str, Any]:
    """One answered camera frame; its response.done."""
    image = base64.b64encode(camera_jpeg(i)).decode()
    await ws.send(json.dumps({"type": "frame.append", "image": image, "prompt": prompt}))
    done = await recv_type(ws, "response.done", "error")
    assert done["type"] == "response.done" and done["status"] == "completed", done
    return done


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
