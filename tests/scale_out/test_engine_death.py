"""A dead engine and a dead store lose no session (issue #50): two real `vllm-realtime serve`
replicas of the default model (`smol-qwen2-vl`) on loopback share one real redis-server, which
this module stops and starts again.

* Redis goes away mid-session, then comes back with its data (saved, restarted): the session
  is served throughout, the reply during the outage says `stored: false`, and the keeper writes
  the missed fold by itself once Redis answers. Then a 30 s outage that ends with a Redis that
  lost everything: the replies say `stored: false`, the owner writes each session's whole record
  again (a video session's retained frames included) as soon as Redis is back, and both
  sessions then resume on the other replica.
* A slow reader (5,000 `frame.append` sent without reading a byte) holds no memory on the
  server, which serves another client meanwhile.
* The EngineCore of the replica holding a text session (through the Python SDK, behind a TCP
  forwarder standing in for the router) and a video session is SIGKILLed, and the text
  session's next chunk is sent at once: both sessions get `server.draining` with `handover`,
  the SDK resumes on the other replica and sends the chunk whose reply was lost again, the
  video session is resumed there by hand; their replies equal the same sessions' on one
  replica (greedy). The dead replica exits with status 3 and leaves no engine process.
  (Last in this module: it kills a replica.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from vllm_realtime_client import connect as sdk_connect

from tests.scale_out.conftest import (
    OPEN_VIDEO,
    VIDEO_ARGS,
    Proxy,
    Replica,
    close,
    events_until_closed,
    free_port,
    open_session,
    replica_pair,
    resume,
    say,
    sessions_on,
    show,
    start_redis,
)

pytestmark = pytest.mark.slow

OUTAGE_S = 30.0
ENGINE_DEAD_EXIT_STATUS = 3  # realtime.server (not imported: it pulls in the server)
OPEN_TEXT = {
    "type": "session.open",
    "modality": "text",
    "instructions": "You are a helpful assistant. Answer in one short sentence.",
    "retention": {"sink_chunks": 1, "window_chunks": 6},
    "sampling": {"max_tokens": 16, "temperature": 0.0},
    "resumable": {"grace_s": 60},
}
TURNS = ["Remember this: my dog's name is Biscuit.", "The weather is sunny today."]
QUESTION = "What is my dog's name?"


class RestartableRedis:
    """redis-server on a fixed port and directory, stopped and started again by the tests."""

    def __init__(self, tmp: Path) -> None:
        self.dir, self.port = tmp, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc, url = start_redis(self.dir, self.port)
        assert url == self.url

    def stop(self, *, keep_data: bool) -> None:
        """Stop it; `keep_data`: after a SAVE, so the next start loads what it held."""
        assert self.proc is not None
        if keep_data:
            import redis as sync_redis

            with sync_redis.Redis(port=self.port) as client:
                client.save()
        else:
            (self.dir / "dump.rdb").unlink(missing_ok=True)
        self.proc.kill()  # no goodbye, no save at shutdown
        self.proc.wait(timeout=10)
        if not keep_data:
            (self.dir / "dump.rdb").unlink(missing_ok=True)


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RestartableRedis]:
    server = RestartableRedis(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.terminate()
            server.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def redis_url(redis: RestartableRedis) -> str:  # the conftest's redis_client uses this one
    return redis.url


@pytest.fixture(scope="module")
def pair(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Replica]]:
    logdir = tmp_path_factory.mktemp("replicas")
    # Admission by KV and session counts only: the start-up's chunk timings on a loaded machine
    # (load 12 seen) refused the video session on compute, which is not what is tested here.
    args = [*VIDEO_ARGS, "--compute-headroom", "0"]
    with replica_pair(redis_url, logdir, ("death-a", "death-b"), args) as reps:
        yield reps


async def open_text(replica: Replica, **extra: Any) -> tuple[Any, str, str]:
    return await open_session(replica, OPEN_TEXT, **extra)


async def open_video(replica: Replica) -> tuple[Any, str, str]:
    return await open_session(replica, OPEN_VIDEO, resumable={"grace_s": 60})


async def frames_total(client: Any, sid: str) -> int | None:
    with contextlib.suppress(Exception):
        raw = await client.hget(f"vrt:session:{sid}", "state")
        if raw:
            return int(json.loads(raw)["frames_total"])
    return None


async def wait_stored(client: Any, sid: str, frames: int, timeout: float = 20) -> float:
    """Seconds until the store holds the session at `frames` answered chunks."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if await frames_total(client, sid) == frames:
            return time.monotonic() - started
        await asyncio.sleep(0.1)
    raise AssertionError(f"{sid[:12]} not stored at {frames} frames within {timeout} s")


async def test_redis_outages_mid_session(
    pair: list[Replica], redis: RestartableRedis, redis_client: Any
) -> None:
    a, b = pair
    ws, sid, token = await open_text(a)
    assert (await say(ws, TURNS[0]))["stored"] is True
    # 1. Redis stops and comes back with its data: the fold it missed is written by itself.
    redis.stop(keep_data=True)
    during = await say(ws, TURNS[1])
    assert during["stored"] is False, during  # served; not resumable elsewhere for now
    redis.start()
    took = await wait_stored(redis_client, sid, 2)
    print(f"restart with data: the missed fold written {took:.1f} s after Redis was back")
    assert (await say(ws, "I like green tea."))["stored"] is True
    # 2. A 30 s outage, then a Redis that lost everything; a video session beside the text one.
    video, vsid, vtoken = await open_video(a)
    await show(video, 0)
    assert (await show(video, 1))["stored"] is True
    redis.stop(keep_data=False)
    started, seen = time.monotonic(), []
    while time.monotonic() - started < OUTAGE_S:
        done = await say(ws, "Tell me a colour.")
        seen.append(done["stored"])
        await asyncio.sleep(4)
    vdone = await show(video, 2)
    assert vdone["stored"] is False, vdone
    print(f"{len(seen)} text replies during the {OUTAGE_S:.0f} s outage: stored={seen}")
    assert seen and not any(seen)
    texts = 3 + len(seen)
    redis.start()  # empty
    back = time.monotonic()
    await wait_stored(redis_client, sid, texts)
    await wait_stored(redis_client, vsid, 3)
    print(
        f"after a restart that lost the data: both records back in {time.monotonic() - back:.1f} s"
    )
    record = await redis_client.hgetall(f"vrt:session:{vsid}")
    assert sorted(k for k in record if k.startswith("frame:")) == ["frame:0", "frame:1", "frame:2"]
    # Both resume on the other replica from what the owner wrote again.
    await ws.close()
    await video.close()
    new, resumed = await resume(b, sid, token)
    assert resumed["type"] == "session.resumed" and resumed["rebuilt"] is True, resumed
    assert resumed["next_frame_index"] == texts, resumed
    assert "Biscuit" in (await say(new, QUESTION))["text"]
    await close(new)
    vnew, vresumed = await resume(b, vsid, vtoken)
    assert vresumed["type"] == "session.resumed" and vresumed["rebuilt"] is True, vresumed
    assert vresumed["next_frame_index"] == 3, vresumed
    assert (await show(vnew, 3))["stored"] is True
    await close(vnew)
    assert await redis_client.keys("vrt:session:*") == []


async def test_a_slow_reader_holds_no_memory(pair: list[Replica]) -> None:
    b = pair[1]
    server = psutil.Process(b.proc.pid)
    before = server.memory_info().rss
    slow, _, _ = await open_text(b, resumable=None)  # its abort below ends it at once
    frame = json.dumps({"type": "frame.append", "text": "hello", "reply": False})
    started, sent = time.perf_counter(), 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(20):
            for _ in range(5000):
                await slow.send(frame)
                sent += 1
    took = time.perf_counter() - started
    # Another client is served meanwhile.
    other, _, _ = await open_text(b)
    await say(other, "Hello there.")
    await close(other)
    after = server.memory_info().rss
    print(
        f"slow reader: {sent} frame.append in {took:.1f} s; server RSS {before >> 20} -> "
        f"{after >> 20} MiB"
    )
    assert after - before < 64 << 20
    slow.transport.abort()
    for _ in range(100):
        if sessions_on(b) == 0:
            break
        await asyncio.sleep(0.1)
    assert sessions_on(b) == 0


def engine_processes(replica: Replica) -> list[psutil.Process]:
    return psutil.Process(replica.proc.pid).children(recursive=True)


def engine_core(processes: list[psutil.Process]) -> psutil.Process:
    for proc in processes:
        with contextlib.suppress(psutil.Error):
            if "EngineCor" in proc.name() or any("EngineCore" in c for c in proc.cmdline()):
                return proc
    raise AssertionError(f"no EngineCore among {[p.name() for p in processes]}")


@pytest.fixture
async def forwarder(pair: list[Replica]) -> AsyncIterator[Proxy]:
    fwd = Proxy(pair[0].port)
    await fwd.start()
    yield fwd
    assert fwd.server is not None
    fwd.server.close()


async def test_the_engine_dies_and_its_sessions_go_on_elsewhere(
    pair: list[Replica], forwarder: Proxy, redis_client: Any
) -> None:
    a, b = pair
    # The same sessions on one replica, start to end: the reference replies.
    ref, _, _ = await open_text(b)
    for text in TURNS:
        await say(ref, text)
    reference = await say(ref, QUESTION)
    await close(ref)
    vref, _, _ = await open_video(b)
    for i in range(3):
        await show(vref, i)
    vreference = await show(vref, 3, "What colour is it?")
    await close(vref)
    # On A: a text session through the SDK (via the forwarder), a video session by hand.
    url = f"ws://127.0.0.1:{forwarder.port}/v1/realtime"
    opening = {k: v for k, v in OPEN_TEXT.items() if k != "type"}
    async with sdk_connect(url, api_key="key-a", max_retries=8, retry_backoff=0.2) as session:
        await session.open(**opening)
        for text in TURNS:
            await session.append_text(text)
        video, vsid, vtoken = await open_video(a)
        for i in range(3):
            await show(video, i)
        processes = engine_processes(a)
        core = engine_core(processes)
        core.kill()
        killed = time.perf_counter()
        forwarder.target_port = b.port  # the router stops sending connections to A
        # Sent at once: accepted by A's server, its reply lost with the engine.
        stream = session.stream_text(QUESTION)
        done = await stream.result()
        text_first = time.perf_counter() - killed
        assert session.resumes == 1 and session.chunks_resent == 1, session.resumes
        assert done.text == reference["text"], (done.text, reference["text"])  # greedy
        assert session.generation == 1  # the same session, context intact
        seen = await events_until_closed(video)
        draining = [e for e in seen if e["type"] == "server.draining"]
        assert draining and draining[0]["handover"] is True, seen
        assert seen[-1]["type"] == "session.closed" and seen[-1]["reason"] == "server_shutdown"
        assert not any(e["type"] == "error" for e in seen), seen
        vnew, vresumed = await resume(b, vsid, vtoken)
        assert vresumed["type"] == "session.resumed" and vresumed["rebuilt"] is True, vresumed
        assert vresumed["next_frame_index"] == 3, vresumed
        vdone = await show(vnew, 3, "What colour is it?")
        video_first = time.perf_counter() - killed
        assert vdone["text"] == vreference["text"], (vdone["text"], vreference["text"])
        await close(vnew)
        status = await asyncio.to_thread(a.proc.wait, 60)
        exited = time.perf_counter() - killed
        await session.close()

    def alive() -> list[str]:
        left = []
        for proc in processes:
            with contextlib.suppress(psutil.Error):
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    left.append(proc.name())
        return left

    at_exit = alive()
    for _ in range(100):  # multiprocessing's resource tracker follows its parent's exit
        if not alive():
            break
        await asyncio.sleep(0.1)
    gone = time.perf_counter() - killed
    print(
        f"engine SIGKILL: text session's resent chunk answered on the other replica "
        f"{text_first:.2f} s after the kill, video session's next frame {video_first:.2f} s; "
        f"the dead replica exited with status {status} after {exited:.1f} s; "
        f"{len(processes)} processes below it: {at_exit} still running at its exit, "
        f"{alive()} at {gone:.1f} s"
    )
    assert status == ENGINE_DEAD_EXIT_STATUS, a.log.read_text()[-3000:]
    assert alive() == [] and gone - exited < 10
    assert exited < 60  # the server stops within about a second; a timer bounds the rest (20 s)
    log = a.log.read_text()
    assert log.count("engine died: session handed over") == 2, log[-3000:]
    assert await redis_client.keys("vrt:session:*") == []
