"""Manual check of docs/scale-out.md: two real replicas behind docker/nginx/realtime.conf.

    .venv/bin/python -m bench.scale_out_check

Starts two `vllm-realtime serve` replicas of the tiny model on loopback ports and Debian's nginx
(`apt-get install nginx-light`) with the router config rewritten to those ports, drives
HTTP-adapter sessions (each with its own X-Session-Key) and WebSocket sessions through the
router, reads every replica's /health session count to see where the sessions live, and stops
everything it started. With Debian's redis-server the replicas share a session store, and a
stored session resumes through the router: back on its owner, then (the owner SIGKILLed)
rebuilt on the other replica. Exit status 0 when every check held.

A rolling restart under load (`--rolling-restart [--modality text|video] [--sessions 8] [--fps 1]
[--compute-headroom H] [--keep-logs DIR]`, issue #39):
Starts Debian's redis-server, two `vllm-realtime serve` replicas of the tiny model sharing it
(`--session-store`), and nginx with docker/nginx/realtime.conf in front. N resumable text
sessions, each with its own `?session_key=`, send one text turn every 1/fps seconds through the
router. With `--modality video` the replicas serve the default model (smol-qwen2-vl) and each
session is a resumable camera session as the web page opens it (window 4, max_tokens 8, one
image per chunk, its frame rate declared) sending one 224x224 solid-colour JPEG every 1/fps
seconds. While one replica restarts the other must admit every session (`--compute-headroom`
is passed to the replicas; their default, 0.5, admits about 5 such sessions at 1 fps on a
loaded 2-core machine). Then replica 1 is drained (SIGTERM), started again, and replica 2
likewise. A session
whose server drains gets `server.draining` with `handover: true`, reconnects through the router
(the draining replica answers 503, nginx moves on) and resumes with its last token. Reports, per
session, the turns answered, how often it moved, and its longest gap between two answered turns;
the rebuilds the replicas logged, and /proc/loadavg sampled during the run; exit status 0 when
every session survived (no new session, no `session_not_found`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
NGINX_CONF = ROOT / "docker" / "nginx" / "realtime.conf"
REPLICA_ARGS = [
    "--model",
    "tiny-qwen2-vl",
    "--kv-cache-memory-bytes",
    "33554432",
    "--max-model-len",
    "1024",
    "--block-size",
    "32",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def render_router_conf(listen: int, replicas: list[int]) -> str:
    """docker/nginx/realtime.conf with loopback addresses instead of the compose names."""
    conf = NGINX_CONF.read_text()
    conf = conf.replace("listen 8080;", f"listen 127.0.0.1:{listen};")
    for i, port in enumerate(replicas, 1):
        conf = conf.replace(f"server replica-{i}:8000", f"server 127.0.0.1:{port}")
    if "replica-" in re.sub(r"#.*", "", conf):
        raise ValueError("the router config names replicas this rewrite does not know")
    return conf


def nginx_binary() -> str | None:
    return shutil.which("nginx") or (
        "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None
    )


def start_nginx(
    nginx: str, workdir: Path, listen: int, replicas: list[int]
) -> subprocess.Popen[bytes]:
    """nginx in the foreground with the router config, everything under `workdir`."""
    (workdir / "logs").mkdir(exist_ok=True)
    (workdir / "realtime.conf").write_text(render_router_conf(listen, replicas))
    user = "user root;\n" if os.geteuid() == 0 else ""
    temp = "".join(
        f"    {kind}_temp_path {workdir}/{kind};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    (workdir / "nginx.conf").write_text(
        f"{user}worker_processes 1;\npid {workdir}/nginx.pid;\n"
        f"error_log {workdir}/logs/error.log;\nevents {{ worker_connections 256; }}\n"
        f"http {{\n    access_log off;\n{temp}    include {workdir}/realtime.conf;\n}}\n"
    )
    proc = subprocess.Popen(
        [nginx, "-p", str(workdir), "-c", str(workdir / "nginx.conf"), "-g", "daemon off;"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    wait_for_port(listen, 15, proc)
    return proc


def wait_for_port(port: int, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise RuntimeError(f"process exited ({proc.returncode}): {out[-2000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing listens on port {port}")
        time.sleep(0.1)


def http(
    method: str, url: str, *, key: str | None = None, body: bytes | None = None, ctype: str = ""
) -> tuple[int, Any]:
    req = urllib.request.Request(url, method=method, data=body)
    if key is not None:
        req.add_header("X-Session-Key", key)
    if ctype:
        req.add_header("Content-Type", ctype)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def sessions_on(port: int) -> int:
    status, body = http("GET", f"http://127.0.0.1:{port}/health")
    assert status == 200, body
    return int(body["sessions"])


@contextlib.contextmanager
def replicas(
    ports: list[int], logdir: Path, extra: tuple[str, ...] = ()
) -> Iterator[list[subprocess.Popen[bytes]]]:
    exe = ROOT / ".venv" / "bin" / "vllm-realtime"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "realtime.cli"]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "TOKENIZERS_PARALLELISM": "false"}
    procs = []
    try:
        for i, port in enumerate(ports, 1):
            log = (logdir / f"replica-{i}.log").open("wb")
            procs.append(
                subprocess.Popen(
                    [*cmd, "serve", "--port", str(port), *REPLICA_ARGS, *extra],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    cwd=ROOT,
                    # Its own process group: the engine's processes (EngineCore, worker) are
                    # stopped with it, even when the server is killed before it shuts them down.
                    start_new_session=True,
                )
            )
        yield procs
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # whatever of its group is left


def wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"replica on port {port} exited with {proc.returncode}")
        with contextlib.suppress(OSError, urllib.error.URLError):
            if http("GET", f"http://127.0.0.1:{port}/health")[0] == 200:
                return
        time.sleep(1)
    raise TimeoutError(f"replica on port {port} not healthy after {timeout_s:.0f} s")


def check(router: int, ports: list[int], log: list[str]) -> bool:
    """Sessions through the router land on both replicas, over HTTP and over WebSocket."""
    http_ok = _check_http(router, ports, log)
    return _check_websocket(router, ports, log) and http_ok


def _check_http(router: int, ports: list[int], log: list[str]) -> bool:
    """8 HTTP sessions, each with its own key: spread over the replicas by the key's hash."""
    from bench.driver import frame_jpeg

    ok = True
    base = f"http://127.0.0.1:{router}"
    open_body = json.dumps({"modality": "video", "sampling": {"max_tokens": 2}}).encode()
    # HTTP adapter: 8 sessions, each with its own key.
    sessions: list[tuple[str, str, int]] = []
    before = [sessions_on(p) for p in ports]
    for n in range(8):
        key = f"check-{n}-{os.urandom(4).hex()}"
        status, body = http("POST", f"{base}/v1/streaming/sessions", key=key, body=open_body)
        assert status == 200, body
        counts = [sessions_on(p) for p in ports]
        where = next(i for i, (a, b) in enumerate(zip(counts, before, strict=True)) if a > b)
        before = counts
        sessions.append((key, body["session_id"], where))
    log.append(f"HTTP: 8 sessions opened, per replica: {before}")
    ok &= all(c > 0 for c in before)
    for key, sid, where in sessions:
        for i in range(3):
            status, done = http(
                "POST",
                f"{base}/v1/streaming/sessions/{sid}/frame",
                key=key,
                body=frame_jpeg(i, size=112),
                ctype="image/jpeg",
            )
            good = status == 200 and done.get("type") == "response.done"
            ok &= good
            if not good:
                log.append(f"  {sid} frame {i}: {status} {str(done)[:200]}")
        log.append(f"  {sid[:16]} on replica-{where + 1}: 3 frames answered")
    # The same session with another client's key: lands wherever that key hashes.
    key, sid, where = sessions[0]
    other = next((k for k, _, w in sessions if w != where), None)
    if other is not None:
        status, body = http(
            "POST",
            f"{base}/v1/streaming/sessions/{sid}/frame",
            key=other,
            body=frame_jpeg(9, size=112),
            ctype="image/jpeg",
        )
        log.append(
            f"  {sid[:16]} sent with a key of replica-{2 - where}: {status} "
            f"{(body or {}).get('error', {}).get('code', body.get('type') if body else None)}"
        )
        ok &= status == 404
    for key, sid, _ in sessions:
        status, _ = http("DELETE", f"{base}/v1/streaming/sessions/{sid}", key=key)
        ok &= status == 200
    log.append(f"HTTP: closed, per replica: {[sessions_on(p) for p in ports]}")
    return bool(ok)


def _check_websocket(router: int, ports: list[int], log: list[str]) -> bool:
    """Two WebSocket sessions: least_conn puts one on each replica."""
    from websockets.sync.client import connect

    from bench.driver import frame_jpeg

    ok = True
    with contextlib.ExitStack() as stack:
        conns = []
        for _ in range(2):
            ws = stack.enter_context(
                connect(f"ws://127.0.0.1:{router}/v1/realtime", subprotocols=["vllm-realtime"])  # type: ignore[list-item]
            )
            conns.append(ws)
            json.loads(ws.recv(timeout=30))  # session.created
            ws.send(
                json.dumps(
                    {"type": "session.open", "modality": "video", "sampling": {"max_tokens": 2}}
                )
            )
            assert json.loads(ws.recv(timeout=30))["type"] == "session.opened"
        counts = [sessions_on(p) for p in ports]
        log.append(f"WebSocket: 2 sessions open, per replica: {counts}")
        ok &= counts == [1, 1]
        for n, ws in enumerate(conns):
            ws.send(json.dumps({"type": "frame.append", "binary": True}))
            ws.send(frame_jpeg(1, size=112))
            while (event := json.loads(ws.recv(timeout=120)))["type"] != "response.done":
                pass
            # max_tokens=2: the reply stops at max_tokens ("incomplete") or ends ("completed").
            ok &= event["status"] in ("completed", "incomplete")
            log.append(f"  WebSocket session {n + 1}: response.done {event['status']}")
            ws.send(json.dumps({"type": "session.close"}))
    return bool(ok)


@contextlib.contextmanager
def redis_server(workdir: Path) -> Iterator[str | None]:
    """Debian's redis-server on a loopback port (the replicas' session store); None without it."""
    binary = shutil.which("redis-server")
    if binary is None:
        yield None
        return
    port = free_port()
    args = ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir)]
    proc = subprocess.Popen(
        [binary, *args, "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, 15, proc)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _ws_turn(ws: Any, text: str) -> dict[str, Any]:
    ws.send(json.dumps({"type": "frame.append", "text": text}))
    while (event := json.loads(ws.recv(timeout=120)))["type"] not in ("response.done", "error"):
        pass
    return dict(event)


def _ws_resume(ws: Any, sid: str, token: str) -> dict[str, Any]:
    json.loads(ws.recv(timeout=30))  # session.created
    ws.send(json.dumps({"type": "session.resume", "session_id": sid, "resume_token": token}))
    return dict(json.loads(ws.recv(timeout=120)))


def check_resume(
    router: int, ports: list[int], procs: list[subprocess.Popen[bytes]], log: list[str]
) -> bool:
    """A stored session through the router (issue #39): its keyed reconnect returns to its
    owner (no rebuild); after the owner is SIGKILLed the next one is rebuilt on the other."""
    from websockets.sync.client import connect

    url = f"ws://127.0.0.1:{router}/v1/realtime?session_key={os.urandom(8).hex()}"
    with connect(url, subprotocols=["vllm-realtime"]) as ws:  # type: ignore[list-item]
        json.loads(ws.recv(timeout=30))
        ws.send(
            json.dumps(
                {
                    "type": "session.open",
                    "modality": "text",
                    "sampling": {"max_tokens": 4},
                    "resumable": {"grace_s": 60},
                }
            )
        )
        opened = json.loads(ws.recv(timeout=60))
        ok = _ws_turn(ws, "First turn.")["type"] == "response.done"
    sid, token = opened["session_id"], opened["resume_token"]
    owner = next(i for i, p in enumerate(ports) if sessions_on(p) == 1)
    with connect(url, subprotocols=["vllm-realtime"]) as ws:  # type: ignore[list-item]
        resumed = _ws_resume(ws, sid, token)  # parked on its owner: the router brings it back
        ok &= resumed.get("type") == "session.resumed" and resumed.get("rebuilt") is False
        ok &= _ws_turn(ws, "Second turn.")["type"] == "response.done"
    log.append(f"resume: via the router back on replica-{owner + 1}: rebuilt={resumed['rebuilt']}")
    os.killpg(procs[owner].pid, signal.SIGKILL)
    procs[owner].wait(timeout=30)
    started = time.perf_counter()
    with connect(url, subprotocols=["vllm-realtime"]) as ws:  # type: ignore[list-item]
        resumed = _ws_resume(ws, sid, resumed.get("resume_token", ""))
        took = time.perf_counter() - started
        ok &= resumed.get("type") == "session.resumed" and resumed.get("rebuilt") is True
        done = _ws_turn(ws, "Third turn.")
        ok &= done["type"] == "response.done" and done.get("frame_index") == 2
        ws.send(json.dumps({"type": "session.close"}))
    log.append(
        f"resume: replica-{owner + 1} SIGKILLed; via the router rebuilt={resumed.get('rebuilt')} "
        f"({resumed.get('reprefilled_tokens')} tokens re-prefilled, {took:.2f} s), "
        f"next reply {done.get('status')}"
    )
    return bool(ok)


def main() -> int:
    if sys.argv[1:2] == ["--rolling-restart"]:
        return rolling_restart(sys.argv[2:])
    nginx = nginx_binary()
    if nginx is None:
        print("nginx is not installed (apt-get install nginx-light)", file=sys.stderr)
        return 2
    ports = [free_port(), free_port()]
    router = free_port()
    log: list[str] = []
    with tempfile.TemporaryDirectory(prefix="scale-out-") as tmp:
        workdir = Path(tmp)
        t0 = time.monotonic()
        with (
            redis_server(workdir) as store,
            replicas(ports, workdir, () if store is None else ("--session-store", store)) as procs,
        ):
            for port, proc in zip(ports, procs, strict=True):
                wait_healthy(port, proc, 600)
            log.append(f"2 replicas healthy after {time.monotonic() - t0:.0f} s (ports {ports})")
            proxy = start_nginx(nginx, workdir, router, ports)
            try:
                ok = check(router, ports, log)
                if store is None:
                    log.append("resume: skipped (redis-server is not installed)")
                else:
                    ok &= check_resume(router, ports, procs, log)
            finally:
                proxy.terminate()
                proxy.wait(timeout=10)
    log.append(f"{'OK' if ok else 'FAILED'}: total {time.monotonic() - t0:.0f} s")
    print("\n".join(log))
    return 0 if ok else 1


OPEN = {
    "type": "session.open",
    "modality": "text",
    "sampling": {"max_tokens": 4},
    "retention": {"sink_chunks": 1, "window_chunks": 4},
    "limits": {"max_chunk_tokens": 32},
    "resumable": {"grace_s": 60},
}


# The default model, with KV for 8 camera sessions on one replica (the other one drains):
# each holds about 5 chunks of 64 image tokens plus text and replies, ~450 tokens.
VIDEO_MODEL_ARGS = ["--model", "smol-qwen2-vl", "--kv-cache-memory-bytes", str(256 << 20)]


def replica_args(modality: str) -> list[str]:
    """REPLICA_ARGS, for video with the default model and a larger KV pool."""
    if modality == "text":
        return REPLICA_ARGS
    flags = dict(zip(REPLICA_ARGS[::2], REPLICA_ARGS[1::2], strict=True))
    flags.update(zip(VIDEO_MODEL_ARGS[::2], VIDEO_MODEL_ARGS[1::2], strict=True))
    return [x for pair in flags.items() for x in pair]


def open_event(modality: str, fps: float) -> dict[str, Any]:
    """The session.open of a text session, or of a camera session as the web page sends it."""
    if modality == "text":
        return OPEN
    return {
        "type": "session.open",
        "modality": "video",
        "instructions": "Name the colour you see.",
        "retention": {"window_chunks": 4},
        "sampling": {"max_tokens": 8},
        "resumable": {"grace_s": 30},
        "limits": {"max_clip_frames": 1, "frames_per_s": fps},
    }


def solid_jpegs(session: int, count: int = 6, size: int = 224) -> list[bytes]:
    """`count` small solid-colour JPEGs, a different series of colours for each session."""
    import io

    from PIL import Image

    frames = []
    for n in range(count):
        rgb = tuple((37 * session + 89 * n + 60 * c) % 256 for c in range(3))
        buf = io.BytesIO()
        Image.new("RGB", (size, size), rgb).save(buf, format="JPEG", quality=85)
        frames.append(buf.getvalue())
    return frames


@dataclass
class Client:
    """One live session: its key, token, and what happened to it."""

    key: str
    open: dict[str, Any] = field(default_factory=lambda: OPEN)
    frames: list[bytes] = field(default_factory=list)  # empty: a text session
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

    def median_gap(self) -> float:
        """The usual time between two answered turns (a turn plus the pause): the baseline."""
        import statistics

        gaps = [b - a for a, b in itertools.pairwise(self.answered)]
        return statistics.median(gaps) if gaps else 0.0


def start_replica(
    port: int, logdir: Path, store: str, name: str, flags: list[str] = REPLICA_ARGS
) -> subprocess.Popen[bytes]:
    exe = ROOT / ".venv" / "bin" / "vllm-realtime"
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "realtime.cli"]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(
        [*cmd, "serve", "--port", str(port), *flags, "--session-store", store],
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
            await ws.send(json.dumps(client.open))
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
            if client.frames:  # one image chunk: its event, then its bytes
                await ws.send(json.dumps({"type": "frame.append", "binary": True}))
                await ws.send(client.frames[n % len(client.frames)])
            else:
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
    i: int, procs: list[subprocess.Popen[bytes]], ports: list[int], env: tuple[Path, str, list[str]]
) -> float:
    """SIGTERM replica i, wait for its exit, start it again; seconds until it is healthy."""
    logdir, store, flags = env
    started = time.monotonic()
    procs[i].send_signal(signal.SIGTERM)
    procs[i].wait(timeout=120)
    procs[i] = start_replica(ports[i], logdir, store, f"replica-{i + 1}-restarted", flags)
    wait_healthy(ports[i], procs[i], 600)
    return time.monotonic() - started


async def restart_under_load(
    router: int, procs: list[subprocess.Popen[bytes]], ports: list[int], args: Any, env: Any
) -> list[Client]:
    video = args.modality == "video"
    clients = [
        Client(
            key=os.urandom(8).hex(),
            open=open_event(args.modality, args.fps),
            frames=solid_jpegs(n) if video else [],
        )
        for n in range(args.sessions)
    ]
    stop = asyncio.Event()
    tasks = [asyncio.create_task(run_client(router, c, args.fps, stop)) for c in clients]
    loads = asyncio.create_task(sample_loadavg(stop))
    await asyncio.sleep(10)  # every session has a few turns on its first replica
    for i in range(len(procs)):
        took = await asyncio.to_thread(drain_and_restart, i, procs, ports, env)
        print(f"replica-{i + 1} drained and back in {took:.0f} s", flush=True)
        await asyncio.sleep(10)
    stop.set()
    await asyncio.gather(*tasks)
    print(f"/proc/loadavg (1-min) during the run, every 10 s: {await loads}")
    return clients


async def sample_loadavg(stop: asyncio.Event) -> list[float]:
    """The 1-minute load average every 10 s until `stop`: how loaded the shared machine was."""
    samples: list[float] = []
    while not stop.is_set():
        samples.append(float(Path("/proc/loadavg").read_text().split()[0]))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 10)
    return samples


def rebuilds_logged(logdir: Path) -> list[str]:
    """The replicas' `session rebuilt` lines, as `tokens in seconds` per replica log."""
    found = []
    for log in sorted(logdir.glob("replica-*.log")):
        for m in re.finditer(r"session rebuilt id=\S+ tokens=(\d+) in ([\d.]+) s", log.read_text()):
            found.append(f"{log.stem}: {m[1]} tok {float(m[2]):.2f} s")
    return found


def rolling_restart(argv: list[str]) -> int:
    """`--rolling-restart`: see the module docstring."""
    parser = argparse.ArgumentParser(description="a rolling restart under live sessions")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--fps", type=float, default=1.0)
    parser.add_argument("--modality", choices=("text", "video"), default="text")
    parser.add_argument(
        "--compute-headroom",
        type=float,
        default=None,
        help="the replicas' --compute-headroom (default: theirs); while one replica restarts the "
        "other must admit every session, so give room for all of them",
    )
    parser.add_argument("--keep-logs", type=Path, default=None, help="copy the logs here")
    args = parser.parse_args(argv)
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
        flags = replica_args(args.modality)
        if args.compute_headroom is not None:
            flags = [*flags, "--compute-headroom", str(args.compute_headroom)]
        procs = [
            start_replica(p, logdir, store, f"replica-{i + 1}", flags) for i, p in enumerate(ports)
        ]
        proxy = start_nginx(nginx, logdir, router, ports)
        try:
            for port, proc in zip(ports, procs, strict=True):
                wait_healthy(port, proc, 600)
            env = (logdir, store, flags)
            clients = asyncio.run(restart_under_load(router, procs, ports, args, env))
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
        rebuilds = rebuilds_logged(logdir)
    print(f"rebuilds logged ({len(rebuilds)}): {', '.join(rebuilds)}")
    for n, c in enumerate(clients):
        print(
            f"session {n + 1}: {len(c.answered)} turns answered, moved {c.moves}x "
            f"(rebuilt {c.rebuilt}x), longest gap {c.longest_gap():.1f} s "
            f"(median {c.median_gap():.1f} s)"
            + (f", LOST: {c.lost} (refusals: {c.refusals[-6:]})" if c.lost else "")
        )
    lost = sum(c.lost is not None for c in clients)
    print(f"{'OK' if not lost else 'FAILED'}: {lost} of {len(clients)} sessions lost")
    return 0 if not lost else 1


if __name__ == "__main__":
    sys.exit(main())
