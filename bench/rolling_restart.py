"""A rolling restart of two replicas under live resumable sessions (issue #39).

    .venv/bin/python -m bench.rolling_restart [--sessions 8] [--fps 1]

Starts Debian's redis-server, two `vllm-realtime serve` replicas of the tiny model sharing it
(`--session-store`), and nginx with docker/nginx/realtime.conf in front. N resumable text
sessions, each with its own `?session_key=`, send one text turn every 1/fps seconds through the
router. Then replica 1 is drained (SIGTERM), started again, and replica 2 likewise. A session
whose server drains gets `server.draining` with `handover: true`, reconnects through the router
(the draining replica answers 503, nginx moves on) and resumes with its last token. Reports, per
session, the turns answered, how often it moved, and its longest gap between two answered turns;
exit status 0 when every session survived (no new session, no `session_not_found`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.scale_out_check import (
    REPLICA_ARGS,
    ROOT,
    free_port,
    nginx_binary,
    redis_server,
    start_nginx,
    wait_healthy,
)

OPEN = {
    "type": "session.open",
    "modality": "text",
    "sampling": {"max_tokens": 4},
    "retention": {"sink_chunks": 1, "window_chunks": 4},
    "limits": {"max_chunk_tokens": 32},
    "resumable": {"grace_s": 60},
}


@dataclass
class Client:
    """One live session: its key, token, and what happened to it."""

    key: str
    session_id: str = ""
    token: str = ""
    answered: list[float] = field(default_factory=list)
    moves: int = 0
    rebuilt: int = 0
    lost: str | None = None
    refusals: list[str] = field(default_factory=list)

    def longest_gap(self) -> float:
        stamps = self.answered
        return max((b - a for a, b in itertools.pairwise(stamps)), default=0.0)


def start_replica(port: int, logdir: Path, store: str, name: str) -> subprocess.Popen[bytes]:
    exe = ROOT / ".venv" / "bin" / "vllm-realtime"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "realtime.cli"]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(
        [*cmd, "serve", "--port", str(port), *REPLICA_ARGS, "--session-store", store],
        stdout=(logdir / f"{name}.log").open("wb"),
        stderr=subprocess.STDOUT,
        env=env,
        cwd=ROOT,
        start_new_session=True,
    )


async def _attach(url: str, client: Client) -> Any:
    """Connect through the router and open (first time) or resume the session."""
    import websockets

    for attempt in range(60):
        try:
            ws = await websockets.connect(url, subprotocols=["vllm-realtime"])  # type: ignore[list-item]
        except (OSError, websockets.InvalidStatus) as exc:
            status = getattr(getattr(exc, "response", None), "status_code", "")
            client.refusals.append(f"{type(exc).__name__}{status}@{time.monotonic():.0f}")
            await asyncio.sleep(0.25 * min(attempt + 1, 4))
            continue
        json.loads(await ws.recv())  # session.created
        if not client.session_id:
            await ws.send(json.dumps(OPEN))
        else:
            await ws.send(
                json.dumps(
                    {
                        "type": "session.resume",
                        "session_id": client.session_id,
                        "resume_token": client.token,
                    }
                )
            )
        answer = json.loads(await ws.recv())
        if answer["type"] in ("session.opened", "session.resumed"):
            client.session_id, client.token = answer["session_id"], answer["resume_token"]
            client.rebuilt += bool(answer.get("rebuilt"))
            return ws
        await ws.close()
        client.refusals.append(f"{answer['type']}:{answer.get('error', {}).get('code')}")
        if answer.get("error", {}).get("code") == "session_not_found":
            client.lost = "session_not_found"
            return None
        await asyncio.sleep(0.25)
    client.lost = "could not reconnect"
    return None


async def run_client(router: int, client: Client, fps: float, stop: asyncio.Event) -> None:
    url = f"ws://127.0.0.1:{router}/v1/realtime?session_key={client.key}"
    ws = await _attach(url, client)
    n = 0
    while ws is not None and not stop.is_set():
        n += 1
        moving = False
        try:
            await ws.send(json.dumps({"type": "frame.append", "text": f"Turn {n}."}))
        except Exception:
            moving = True  # the server closed the session (a drain) while we waited
        while not moving:
            try:
                event = json.loads(await asyncio.wait_for(ws.recv(), 120))
            except Exception:
                moving = True  # the socket ended (after server.draining, or a crash)
                break
            if event["type"] == "response.done":
                if event["status"] in ("completed", "incomplete"):
                    client.answered.append(time.monotonic())
                break
            if event["type"] == "session.closed":
                moving = True
                break
        if moving:
            with contextlib.suppress(Exception):
                await ws.close()
            client.moves += 1
            ws = await _attach(url, client)
            continue
        await asyncio.sleep(1 / fps)
    if ws is not None:
        with contextlib.suppress(Exception):
            await ws.send(json.dumps({"type": "session.close"}))
            await ws.close()


def drain_and_restart(
    i: int, procs: list[subprocess.Popen[bytes]], ports: list[int], logdir: Path, store: str
) -> float:
    """SIGTERM replica i, wait for its exit, start it again; seconds until it is healthy."""
    started = time.monotonic()
    procs[i].send_signal(signal.SIGTERM)
    procs[i].wait(timeout=120)
    procs[i] = start_replica(ports[i], logdir, store, f"replica-{i + 1}-restarted")
    wait_healthy(ports[i], procs[i], 600)
    return time.monotonic() - started


async def restart_under_load(
    router: int, procs: list[subprocess.Popen[bytes]], ports: list[int], args: Any, env: Any
) -> list[Client]:
    logdir, store = env
    clients = [Client(key=os.urandom(8).hex()) for _ in range(args.sessions)]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(run_client(router, c, args.fps, stop)) for c in clients]
    await asyncio.sleep(10)  # every session has a few turns on its first replica
    for i in range(len(procs)):
        took = await asyncio.to_thread(drain_and_restart, i, procs, ports, logdir, store)
        print(f"replica-{i + 1} drained and back in {took:.0f} s", flush=True)
        await asyncio.sleep(10)
    stop.set()
    await asyncio.gather(*tasks)
    return clients


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--fps", type=float, default=1.0)
    parser.add_argument("--keep-logs", type=Path, default=None, help="copy the logs here")
    args = parser.parse_args()
    nginx = nginx_binary()
    if nginx is None:
        print("nginx is not installed (apt-get install nginx-light)", file=sys.stderr)
        return 2
    ports, router = [free_port(), free_port()], free_port()
    with tempfile.TemporaryDirectory(prefix="rolling-") as tmp, redis_server(Path(tmp)) as store:
        if store is None:
            print("redis-server is not installed (apt-get install redis-server)", file=sys.stderr)
            return 2
        logdir = Path(tmp)
        procs = [start_replica(p, logdir, store, f"replica-{i + 1}") for i, p in enumerate(ports)]
        proxy = start_nginx(nginx, logdir, router, ports)
        try:
            for port, proc in zip(ports, procs, strict=True):
                wait_healthy(port, proc, 600)
            clients = asyncio.run(restart_under_load(router, procs, ports, args, (logdir, store)))
        finally:
            proxy.terminate()
            if args.keep_logs is not None:
                with contextlib.suppress(OSError, shutil.Error):
                    shutil.copytree(logdir, args.keep_logs, dirs_exist_ok=True)
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGINT)
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=60)
    for n, c in enumerate(clients):
        print(
            f"session {n + 1}: {len(c.answered)} turns answered, moved {c.moves}x "
            f"(rebuilt {c.rebuilt}x), longest gap {c.longest_gap():.1f} s"
            + (f", LOST: {c.lost} (refusals: {c.refusals[-6:]})" if c.lost else "")
        )
    lost = sum(c.lost is not None for c in clients)
    print(f"{'OK' if not lost else 'FAILED'}: {lost} of {len(clients)} sessions lost")
    return 0 if not lost else 1


if __name__ == "__main__":
    sys.exit(main())
