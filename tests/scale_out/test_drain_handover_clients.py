"""The clients follow a drain hand-over on their own (issue #39): two real `vllm-realtime serve`
replicas of SmolLM2-135M share one real redis-server behind Debian's nginx with the shipped
router config (docker/nginx/realtime.conf, rewritten to loopback ports).

The client connects through the router with a `?session_key=` of its own (the keyed upstream:
its reconnects reach the owner while it is up). The test drains the replica that holds the
session (SIGTERM): the server says `server.draining` with `handover: true` and keeps the
session's record; the client reconnects through the router, which moves on to the other
replica, and RESUMES the session there (not a new one): the same session id, generation 1, the
`on_resumed` hook / "resumed" event (never `on_reopened` / "reopened"), rebuilt from the store,
and a fact told before the drain is recalled after it.

* The Python SDK (`vllm_realtime_client.connect`).
* The JS client in Node (clients/js/e2e/handover.e2e.mjs, the `ws` package).

The webcam script (clients/webcam) opens its session through the SDK's `connect`, so its
hand-over is the SDK's (see its docstring); it is not run again here.

Between the two tests the drained replica is started again on its port (one step of a rolling
restart), so the router has two replicas again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.scale_out_check import nginx_binary, start_nginx
from tests.scale_out.conftest import (
    FACT,
    OPEN,
    QUESTION,
    ROOT,
    Replica,
    free_port,
    sessions_on,
    start_replica,
    wait_healthy,
)
from tests.tools import need, need_tool

pytestmark = pytest.mark.slow

JS_DIR = ROOT / "clients" / "js"
SDK_DIR = ROOT / "clients" / "python"
# The SDK from the checkout, as tests/clients/conftest.py puts it (appended: the repository's
# own packages keep precedence).
if str(SDK_DIR) not in sys.path:
    sys.path.append(str(SDK_DIR))


class Cluster:
    """Two replicas on fixed ports behind nginx at `url`."""

    def __init__(self, redis_url: str, logdir: Path, replicas: list[Replica], url: str):
        self.redis_url, self.logdir, self.replicas, self.url = redis_url, logdir, replicas, url
        self.restarts = 0

    def owner(self) -> Replica:
        """The replica that holds the one open session."""
        holding = [r for r in self.replicas if sessions_on(r) == 1]
        assert len(holding) == 1, [sessions_on(r) for r in self.replicas]
        return holding[0]

    def drain(self, replica: Replica) -> None:
        replica.proc.send_signal(signal.SIGTERM)

    def restart(self, replica: Replica) -> None:
        """Wait until the drained replica stopped cleanly, then start it again on its port."""
        assert replica.proc.wait(timeout=120) == 0  # drained and stopped cleanly
        self.restarts += 1
        name = f"replica-{replica.port}-{self.restarts}"
        again = start_replica(self.redis_url, self.logdir, name, port=replica.port)
        self.replicas[self.replicas.index(replica)] = again
        wait_healthy(again)


@pytest.fixture(scope="module")
def cluster(redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    nginx = nginx_binary()
    need(nginx is not None, "nginx is not installed: apt-get install nginx-light")
    assert nginx is not None
    logdir = tmp_path_factory.mktemp("handover")
    ports = [free_port(), free_port()]
    replicas = [
        start_replica(redis_url, logdir, f"replica-{i}", port=port) for i, port in enumerate(ports)
    ]
    proxy = None
    try:
        for r in replicas:
            wait_healthy(r)
        listen = free_port()
        proxy = start_nginx(nginx, logdir, listen, ports)
        yield Cluster(redis_url, logdir, replicas, f"ws://127.0.0.1:{listen}/v1/realtime")
    finally:
        if proxy is not None:
            proxy.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proxy.wait(timeout=10)
        for r in replicas:
            r.stop()


async def test_the_sdk_resumes_a_handed_over_session_on_the_other_replica(
    cluster: Cluster, redis_client: Any
) -> None:
    from vllm_realtime_client import connect

    resumed: list[Any] = []
    reopened: list[Any] = []
    config = {k: v for k, v in OPEN.items() if k != "type"}
    async with connect(
        f"{cluster.url}?session_key=sdk-handover",
        api_key="key-a",
        timeout=180,
        open_timeout=30,
        on_resumed=resumed.append,
        on_reopened=reopened.append,
    ) as session:
        opened = await session.open(config)
        assert (await session.append_text(FACT)).status == "completed"
        owner = cluster.owner()
        cluster.drain(owner)
        # The SDK moves by itself: the next call waits until the session is ready again.
        for _ in range(600):
            if resumed or reopened or session.is_closed:
                break
            await asyncio.sleep(0.2)
        assert reopened == [] and len(resumed) == 1, (resumed, reopened, session.closed)
        assert resumed[0].rebuilt is True and resumed[0].reprefilled_tokens > 0, resumed[0]
        assert session.session_id == opened.session_id
        assert session.generation == 1 and session.resumes == 1
        other = next(r for r in cluster.replicas if r is not owner)
        assert sessions_on(other) == 1
        answer = await session.append_text(QUESTION)
        assert answer.frame_index == 1  # the same session's next chunk
        assert "Biscuit" in answer.text, answer.text
    assert await redis_client.keys("vrt:session:*") == []  # closed: nothing kept
    cluster.restart(owner)


async def test_the_js_client_resumes_a_handed_over_session_on_the_other_replica(
    cluster: Cluster, redis_client: Any
) -> None:
    node = need_tool("node", "install Node.js 20+")
    need(
        (JS_DIR / "node_modules" / "ws").is_dir(), "ws is not installed: npm ci --prefix clients/js"
    )
    env = {
        "RT_URL": f"{cluster.url}?session_key=js-handover",
        "RT_KEY": "key-a",
        "RT_OPEN": json.dumps({k: v for k, v in OPEN.items() if k != "type"}),
        "RT_FACT": FACT,
        "RT_QUESTION": QUESTION,
    }
    proc = await asyncio.create_subprocess_exec(
        node,
        str(JS_DIR / "e2e" / "handover.e2e.mjs"),
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    try:
        first = await asyncio.wait_for(proc.stdout.readline(), 300)
        told = json.loads(first or b"{}")
        assert told.get("status") == "completed", first + await proc.stderr.read()
        owner = cluster.owner()
        cluster.drain(owner)
        out, err = await asyncio.wait_for(proc.communicate(), 300)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, out.decode()[-3000:] + err.decode()[-3000:]
    s = json.loads(out.decode().strip().splitlines()[-1])
    assert s["drains"] and s["drains"][0]["handover"] is True, s
    assert s["how"] == "resumed", s  # not "reopened": the context moved with the session
    assert s["sessionId"] == s["opened"] == told["told"]
    assert s["generation"] == 1 and s["resumes"] == 1
    assert s["rebuilt"] is True and s["reprefilled"] > 0
    assert s["answer"]["frame_index"] == 1 and "Biscuit" in s["answer"]["text"], s
    assert await redis_client.keys("vrt:session:*") == []
    assert owner.proc.wait(timeout=120) == 0  # drained and stopped cleanly
