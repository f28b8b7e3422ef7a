"""Capacity: how many bounded sessions one engine admits, against how many physically fit.

    .venv/bin/python -m bench.capacity --chunks 100 --json docs/bench/capacity.json
    .venv/bin/python -m bench.capacity --model tiny-qwen2-vl --chunks 100 --block-size 32 \
        --pool-blocks 181 --json docs/bench/capacity-video.json

Through the real server (uvicorn on loopback, WebSocket clients, real vLLM; SmolLM2-135M,
max_model_len 2048, the server's default KV size): open bounded text sessions with one budget
until `capacity_exceeded`, then run all admitted sessions at once for `--chunks` chunks each,
every chunk at the largest size the server allows (limits.max_chunk_tokens, template
included) and every reply up to max_tokens. On the video model (tiny-qwen2-vl) the sessions
are video sessions that cap their own chunks (session.open.limits: `--frame-text-tokens`, one
image per frame), and every frame is an image larger than the processor's max pixels (the
most image tokens a frame can be) with a prompt filling the text cap. Reported:

* admitted: sessions the new admission (realtime/admission.py) let in, and what the old rule
  (ceil(max_model_len / block) + 1 per session) admits on the same pool;
* physical fit: pool / the peak blocks one session was measured to hold (from
  response.done.retention.kv_blocks_held, and EngineCore at the end);
* preemptions (engine-side counter of every session), stalls (a chunk that failed or took
  longer than `--stall-s`), blocks leaked after every session closed.

Camera capacity (`--camera URL`): against a running server (`vllm-realtime serve`), N clients
open sessions the way the page does (realtime/static/app.js: instructions, a window, max_tokens,
resumable; `--declare` adds the page's `limits`), and each offers one 224×224 JPEG a second
(`--fps`; a text turn on a text model), skipping a tick while its previous reply is in flight,
as the page does. For N in `--levels` (each level a fresh set of sessions, `--seconds` long;
choose them to pass the first refusal):

    vllm-realtime serve &
    .venv/bin/python -m bench.capacity --camera ws://127.0.0.1:8000/v1/realtime \
        --levels 1,4,8,12,16,20 --json docs/bench/camera-capacity.json

Reported per level: admitted, refused (and the first refusal's message), p50/p99 per frame
(send to response.done), the share of offered frames answered, KV blocks the sessions hold
(their last response.done), and the machine's load average.

Camera box (`--box`): does admission by compute admit what this machine answers in time?

    .venv/bin/python -m bench.capacity --box --json docs/bench/camera-box.json          # ~20-40 min
    .venv/bin/python -m bench.capacity --box --quick --json docs/bench/camera-box-quick.json  # <= 10

Starts `vllm-realtime serve` twice, as a user does (the default model and dtype; extra serve
flags after `--`), and drives it with the camera clients of `--camera` (below) (the
page's session.open: window 4, max_tokens 8; one 224×224 JPEG offered a second, a tick skipped
while the previous reply is in flight):

1. **True capacity**, admission by compute off (`--compute-headroom 0`): 1, 2, 3, ... cameras,
   a fresh set each level, until a level misses the SLO twice in a row (a miss is tried once
   more: one stall of a shared machine must not end the search): p99 per frame within the
   period (1 / fps) and at least 95% of the offered frames answered. The true capacity is the
   largest level that met it. The first `--warmup` seconds of each level (5; cameras opening)
   are not measured.
2. **Admitted**, admission on (serve's default headroom, or `--headroom`): twice the true
   capacity of cameras (at least 2) open at once; reported: how many were admitted, their p99
   and answered share, and admitted / true capacity (target 0.8-1.0, inside the SLO).
3. **True capacity after**, admission off again, searched from the admitted count (up while
   levels meet the SLO, down while they miss): the machine's speed drifts within minutes, so
   admitted / true is also reported against the capacity measured right after it.

With each result: the CPU (`lscpu` model and its bf16/AVX-512 flags), the server's dtype line
and its start-up calibration, and the load average (a shared machine's figures say so).
`--quick`: 20 s a level, at most 6 levels.

Dtype check (`--dtype-check`): one camera (as in `--box`, 30 s after 5 s unmeasured) on serve
as a user starts it, then on `serve --dtype float32`, then on `--dtype bfloat16`; their dtype
lines, p50 and p99, the ratios of the p50s (issue #48: within 10% of float32's on a CPU without
native bf16), and whether serve chose the faster of the two here. `.ci/run` ends with it, so
each CI machine reports its CPU and its figures:

    .venv/bin/python -m bench.capacity --dtype-check --json docs/bench/dtype-check.json

Start-up (`--startup`): the command to `/health` 200, the start-up log's warnings, the dtype and
KV pool lines, and the resident memory of the server's process tree (EngineCore and its worker
included); `--cwd` starts another checkout (A/B back to back):

    .venv/bin/python -m bench.capacity --startup --json docs/bench/startup.json -- \
        --kv-cache-memory-bytes 536870912
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.soak import serve

SUBPROTOCOLS = ["vllm-realtime"]


def _budget(args: argparse.Namespace) -> dict[str, Any]:
    return {"sink_chunks": 1, "window_chunks": args.window}


async def _recv(ws: Any) -> dict[str, Any]:
    return dict(json.loads(await ws.recv()))


def _max_size_text(hub: Any, cap: int, video: bool = False) -> str:
    """A turn text (or frame prompt) whose rendered chunk, template included, is as close to
    the cap as fits."""
    words = ["river", "mill", "boat", "stone", "light", "field", "bridge", "cloud"]
    text = ""
    i = 0
    while True:
        candidate = (text + " " + words[i % len(words)]).strip()
        rendered = hub.chat.chunk(
            candidate, media="image" if video else None, close_reply=True, reply=True
        )
        if hub.count_tokens(rendered) > cap:
            return text
        text = candidate
        i += 1


async def run(args: argparse.Namespace) -> dict[str, Any]:
    video = args.model != "smollm2-135m-instruct"
    settings = _settings(args)
    async with serve(settings, args.model, max_sessions=1000) as srv:
        hub = srv["hub"]
        engine = srv["engine"]
        pool = hub.usable_blocks
        old_rule = math.ceil(hub.max_model_len / hub.block_size) + 1
        config: dict[str, Any] = {
            "type": "session.open",
            "modality": "video" if video else "text",
            "retention": _budget(args),
            "sampling": {"max_tokens": args.max_tokens, "temperature": 0.0},
        }
        text_cap = hub.config.max_chunk_tokens
        if video:
            text_cap = args.frame_text_tokens
            config["limits"] = {"max_chunk_tokens": text_cap, "max_clip_frames": 2}
        sockets, reservation, refusal = await _open_until_refused(srv["url"], config)
        text = _max_size_text(hub, text_cap - 4, video)  # room for the turn number
        image = base64.b64encode(_large_image()).decode() if video else ""
        started = time.perf_counter()
        driven = await asyncio.gather(*(_drive(ws, args, text, image, video) for ws in sockets))
        peaks = [d[0] for d in driven]
        stalls = sum(d[1] for d in driven)
        latencies = [t for d in driven for t in d[2]]
        elapsed = time.perf_counter() - started
        preemptions, free = await _preemptions_and_settle(hub, engine, sockets, pool)
        peak = max(peaks) if peaks else 0
        physical_fit = pool // peak if peak else 0
        admitted = len(sockets)
        return {
            "model": args.model,
            "modality": config["modality"],
            "session_limits": config.get("limits"),
            "max_model_len": hub.max_model_len,
            "pool_blocks": pool,
            "block_size": hub.block_size,
            "budget": _budget(args),
            "max_tokens": args.max_tokens,
            "max_chunk_tokens": hub.config.max_chunk_tokens,
            "chunk_text_tokens": hub.count_tokens(text),
            "frame_media_tokens": hub.media.image_tokens if video and hub.media else 0,
            "chunks_per_session": args.chunks,
            "reservation": reservation,
            "admitted": admitted,
            "admitted_old_rule": pool // old_rule,
            "old_rule_blocks_per_session": old_rule,
            "refusal": refusal,
            "peak_blocks_per_session": peak,
            "physical_fit": physical_fit,
            "admitted_over_physical_fit": round(admitted / physical_fit, 3)
            if physical_fit
            else None,
            "preemptions": preemptions,
            "stalls": stalls,
            "blocks_leaked": pool - free,
            "elapsed_s": round(elapsed, 1),
            "chunk_latency_p50_s": round(sorted(latencies)[len(latencies) // 2], 3)
            if latencies
            else None,
        }


def _settings(args: argparse.Namespace) -> Any:
    from realtime.engine import EngineSettings

    settings = EngineSettings(
        model=args.model,
        max_model_len=2048,
        dtype="float32",
        max_num_seqs=256,
        block_size=args.block_size,
        introspection=True,  # retention_state: the held blocks each session reports
    )
    if args.pool_blocks:
        # A pool of that many blocks (the tiny VLM's default KV size is thousands of blocks).
        per_block = (args.block_size or 32) * _kv_bytes_per_token(args.model)
        settings = settings.with_overrides(kv_cache_memory_bytes=args.pool_blocks * per_block)
    return settings


async def _open_until_refused(
    url: str, config: dict[str, Any]
) -> tuple[list[Any], dict[str, Any] | None, str]:
    """Open sessions until admission refuses one: the open sockets, the last reservation, the refusal."""
    import websockets

    sockets: list[Any] = []
    reservation: dict[str, Any] | None = None
    refusal = ""
    while True:
        ws = await websockets.connect(url, subprotocols=SUBPROTOCOLS, max_size=None)
        await _recv(ws)
        await ws.send(json.dumps(config))
        reply = await _recv(ws)
        if reply["type"] != "session.opened":
            refusal = reply["error"]["message"]
            await ws.close()
            break
        reservation = reply["reservation"]
        sockets.append(ws)
    return sockets, reservation, refusal


async def _drive(
    ws: Any, args: argparse.Namespace, text: str, image: str, video: bool
) -> tuple[int, int, list[float]]:
    """One session's chunks: its peak KV blocks, its stalls, its chunk latencies."""
    peak, stalls, latencies = 0, 0, []
    for n in range(args.chunks):
        t0 = time.perf_counter()
        if video:
            event = {"type": "frame.append", "image": image, "prompt": f"{n} {text}"}
        else:
            event = {"type": "frame.append", "text": f"{n} {text}"}
        await ws.send(json.dumps(event))
        while True:
            event = await asyncio.wait_for(_recv(ws), args.stall_s * 4)
            if event["type"] == "response.done":
                break
            if event["type"] == "error":
                return peak, stalls + 1, latencies
        dt = time.perf_counter() - t0
        latencies.append(dt)
        if event["status"] not in ("completed", "incomplete") or dt > args.stall_s:
            stalls += 1
        peak = max(peak, int(event["retention"]["kv_blocks_held"]))
    return peak, stalls, latencies


async def _preemptions_and_settle(
    hub: Any, engine: Any, sockets: list[Any], pool: int
) -> tuple[int, int]:
    """Preemptions the sessions saw; then close them all and wait for the pool to come back
    (the free blocks after, to count leaks)."""
    from retention.vllm_adapter.introspect import kv_stats, retention_state

    preemptions = 0
    for sid in list(hub.sessions):
        state = await retention_state(engine, sid)
        if state is not None:
            preemptions += int(state["preemptions"])
    for ws in sockets:
        await ws.close()
    for _ in range(200):
        if not hub.sessions and (await kv_stats(engine))["num_free_blocks"] == pool:
            break
        await asyncio.sleep(0.1)
    free = (await kv_stats(engine))["num_free_blocks"]
    return preemptions, free


PAGE_INSTRUCTIONS = "You watch a camera. In one short sentence, say what you see."


def _camera_open(args: argparse.Namespace, text: bool) -> dict[str, Any]:
    """session.open as the page sends it (realtime/static/app.js, openSession)."""
    event: dict[str, Any] = {
        "type": "session.open",
        "instructions": PAGE_INSTRUCTIONS,
        "retention": {"window_chunks": args.window},
        "sampling": {"max_tokens": args.max_tokens},
        "resumable": {"grace_s": 30},
    }
    if text:
        event["modality"] = "text"
    if args.declare:
        event["limits"] = {"max_clip_frames": 1, "frames_per_s": args.fps}
    return event


def _camera_frame(n: int, text: bool) -> dict[str, Any]:
    if text:
        return {"type": "frame.append", "text": f"Frame {n}: a person walks past the door."}
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(n % 8).integers(0, 255, (224, 224, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=80)
    return {"type": "frame.append", "image": base64.b64encode(buf.getvalue()).decode()}


async def _camera_client(
    url: str, args: argparse.Namespace, stats: dict[str, Any], stop: float
) -> None:
    """One camera: open, then offer a frame every 1/fps s until `stop`, skipping a tick while
    the previous reply is in flight (the page's `client.busy`)."""
    import websockets

    async with websockets.connect(url, subprotocols=SUBPROTOCOLS, max_size=None) as ws:
        created = await _recv(ws)
        text = created["limits"].get("max_clip_frames") is None
        await ws.send(json.dumps(_camera_open(args, text)))
        opened = await _recv(ws)
        if opened["type"] != "session.opened":
            stats["refused"].append(opened["error"]["code"] + ": " + opened["error"]["message"])
            return
        stats["admitted"] += 1
        frames = [_camera_frame(n, text) for n in range(8)]
        period = 1.0 / args.fps
        busy: asyncio.Task[None] | None = None
        n = 0

        async def one(event: dict[str, Any]) -> None:
            t0 = time.perf_counter()
            await ws.send(json.dumps(event))
            while (done := await _recv(ws))["type"] not in ("response.done", "error"):
                pass
            if t0 < stats["counted_from"]:
                return  # warm-up: the level's first seconds are not measured
            if done["type"] == "response.done" and done["status"] in ("completed", "incomplete"):
                stats["latencies"].append(time.perf_counter() - t0)
                stats["blocks"][id(ws)] = int(done["retention"]["kv_blocks_held"])
            else:
                stats["failed"] += 1

        next_tick = time.perf_counter()
        while next_tick < stop:
            await asyncio.sleep(max(0.0, next_tick - time.perf_counter()))
            counted = next_tick >= stats["counted_from"]
            next_tick += period
            if counted:
                stats["offered"] += 1
            if busy is not None and not busy.done():
                continue  # skipped: the previous frame's reply is still in flight
            busy = asyncio.create_task(one(frames[n % len(frames)]))
            n += 1
        if busy is not None:
            await busy
        # Closed, not dropped: a dropped resumable session would keep its reservation 30 s.
        await ws.send(json.dumps({"type": "session.close"}))
        while (await _recv(ws))["type"] != "session.closed":
            pass


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3, 1)


async def _camera_level(url: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    warmup = getattr(args, "warmup", 0.0)
    start = time.perf_counter()
    stats: dict[str, Any] = {
        "admitted": 0, "refused": [], "latencies": [], "offered": 0, "failed": 0, "blocks": {},
        # The first frames of a level (cameras opening, staggered over a period) are not
        # what the level sustains.
        "counted_from": start + warmup,
    }  # fmt: skip
    stop = start + warmup + args.seconds
    # Staggered within one period, as independent cameras are.
    clients = []
    for _ in range(n):
        clients.append(asyncio.create_task(_camera_client(url, args, stats, stop)))
        await asyncio.sleep(1.0 / args.fps / n)
    await asyncio.gather(*clients)
    offered = stats["offered"]
    # Offered ticks of admitted sessions only; a refused session offered nothing.
    answered = len(stats["latencies"])
    return {
        "sessions": n,
        "admitted": stats["admitted"],
        "refused": len(stats["refused"]),
        "refusal": stats["refused"][0] if stats["refused"] else None,
        "p50_ms": _percentile(stats["latencies"], 0.50),
        "p99_ms": _percentile(stats["latencies"], 0.99),
        "offered": offered,
        "answered": answered,
        "answered_share": round(answered / offered, 3) if offered else None,
        "failed": stats["failed"],
        "warmup_s": warmup,
        "kv_blocks_held": sum(stats["blocks"].values()),
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


async def camera(args: argparse.Namespace) -> dict[str, Any]:
    levels: list[dict[str, Any]] = []
    for n in args.levels:
        level = await _camera_level(args.camera, n, args)
        print(json.dumps(level), flush=True)
        levels.append(level)
        await asyncio.sleep(2)  # the closed sessions' blocks go back to the pool
    return {
        "url": args.camera,
        "declared": args.declare,
        "window_chunks": args.window,
        "max_tokens": args.max_tokens,
        "fps": args.fps,
        "seconds_per_level": args.seconds,
        "cpus": os.cpu_count(),
        "levels": levels,
    }


def _kv_bytes_per_token(model: str) -> int:
    from realtime.models import model_dir

    config = json.loads((Path(str(model_dir(model))) / "config.json").read_text())
    text = config.get("text_config", config)
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    return int(text["num_hidden_layers"] * 2 * text["num_key_value_heads"] * head_dim * 4)


def _large_image() -> bytes:
    """A frame past the processor's max pixels: it is resized to the most tokens an image is."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    img = Image.fromarray(rng.integers(0, 255, (480, 640, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=80)
    return buf.getvalue()


SLO_ANSWERED = 0.95
WARNING = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|Warning:")


def _health(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return bool(r.status == 200)
    except Exception:
        return False


def _tree_rss(pid: int) -> dict[str, int]:
    import psutil

    root = psutil.Process(pid)
    out: dict[str, int] = {}
    for p in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            out[f"{p.pid} {p.name()}"] = int(p.memory_info().rss)
    return out


def one_start(serve_args: list[str], port: int, cwd: Path, timeout_s: float) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{cwd}:{cwd}/clients/python"
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"startup-{os.getpid()}-{port}.log"
    with log_path.open("w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "realtime.cli", "serve", "--port", str(port), *serve_args],
            cwd=cwd,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        ready = None
        while time.perf_counter() - t0 < timeout_s and proc.poll() is None:
            if _health(port):
                ready = time.perf_counter() - t0
                break
            time.sleep(0.2)
        rss = _tree_rss(proc.pid) if ready is not None else {}
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    text = log_path.read_text(errors="replace")
    lines = text.splitlines()
    startup = lines[
        : next((i for i, line in enumerate(lines) if "startup complete" in line), len(lines))
    ]
    warnings = [line for line in startup if WARNING.search(line)]
    return {
        "health_200_s": round(ready, 1) if ready is not None else None,
        "startup_log_lines": len(startup),
        "warnings": len(warnings),
        "warning_lines": warnings[:40],
        "kv_pool_line": next((line for line in startup if "KV pool" in line), None),
        "dtype_line": next((line for line in startup if "dtype:" in line), None),
        "compute_lines": [line for line in startup if "compute:" in line],
        "rss_bytes": rss,
        "rss_total_mib": round(sum(rss.values()) / (1 << 20)),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "log": str(log_path),
    }


def _commit(cwd: Path) -> str:
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], cwd=cwd, text=True
        ).strip()
    except Exception:
        return "unknown"


def _lscpu() -> dict[str, Any]:
    try:
        out = subprocess.check_output(["lscpu"], text=True)
    except (OSError, subprocess.CalledProcessError):
        return {}
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = info.get("Flags", "").split()
    keep = [f for f in flags if f.startswith(("avx512", "amx", "avx2", "avx_vnni"))]
    return {
        "model": info.get("Model name", "").strip(),
        "cpus": info.get("CPU(s)", "").strip(),
        "flags": keep,
    }


def _health(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
            return bool(r.status == 200)
    except Exception:
        return False


class Server:
    """`python -m realtime.cli serve` in a subprocess, ended with SIGINT."""

    def __init__(self, port: int, serve_args: list[str], log: Path) -> None:
        self.port = port
        self.log = log
        self.args = ["--port", str(port), *serve_args]
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None

    def __enter__(self) -> Server:
        t0 = time.perf_counter()
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "realtime.cli", "serve", *self.args],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            while not _health(self.port):
                if self.proc.poll() is not None or time.perf_counter() - t0 > 900:
                    raise RuntimeError(f"the server did not start; its log: {self.log}")
                time.sleep(0.5)
        except BaseException:
            self.__exit__()  # an interrupt during start-up leaves no engine behind
            raise
        self.startup_s = round(time.perf_counter() - t0, 1)
        return self

    def __exit__(self, *_: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def lines(self, needle: str) -> list[str]:
        text = self.log.read_text(errors="replace")
        return [line.split(" ", 4)[-1] for line in text.splitlines() if needle in line]

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/realtime"


def _client_args(args: argparse.Namespace) -> argparse.Namespace:
    """What bench.capacity's camera clients read."""
    return argparse.Namespace(
        window=args.window, max_tokens=args.max_tokens, fps=args.fps, declare=args.declare,
        seconds=args.seconds, warmup=args.warmup,
    )  # fmt: skip


def meets_slo(level: dict[str, Any], period_ms: float) -> bool:
    p99 = level["p99_ms"]
    share = level["answered_share"]
    return (
        level["admitted"] == level["sessions"]
        and p99 is not None
        and p99 <= period_ms
        and share is not None
        and share >= SLO_ANSWERED
    )


async def _meets(url: str, n: int, args: argparse.Namespace, levels: list[dict[str, Any]]) -> bool:
    """Whether `n` cameras meet the SLO. A level that misses is tried once more: one stall of a
    shared machine (another process, a page-in) must not end a search."""
    for attempt in range(2):
        level = await _camera_level(url, n, _client_args(args))
        level["meets_slo"] = meets_slo(level, 1e3 / args.fps)
        level["attempt"] = attempt + 1
        print(json.dumps(level), flush=True)
        levels.append(level)
        await asyncio.sleep(2)  # the closed sessions' blocks go back to the pool
        if level["meets_slo"]:
            return True
    return False


async def _levels(url: str, args: argparse.Namespace) -> tuple[int, list[dict[str, Any]]]:
    capacity, levels = 0, []
    for n in range(1, args.max_level + 1):
        if not await _meets(url, n, args, levels):
            break
        capacity = n
    return capacity, levels


async def _capacity_near(
    url: str, start: int, args: argparse.Namespace
) -> tuple[int, list[dict[str, Any]]]:
    """The true capacity searched again from `start` (what admission let in): up while levels
    meet the SLO, down while they miss. This VM's speed drifts by a quarter within minutes, so
    the capacity measured before the admitted run can be another moment's."""
    levels: list[dict[str, Any]] = []
    n = max(start, 1)
    if await _meets(url, n, args, levels):
        while n < args.max_level and await _meets(url, n + 1, args, levels):
            n += 1
        return n, levels
    while n > 1:
        n -= 1
        if await _meets(url, n, args, levels):
            return n, levels
    return 0, levels


def _against(admitted_run: dict[str, Any], capacity: int) -> tuple[float | None, bool]:
    """Admitted / true capacity, and whether the target holds: 0.8-1.0, inside the SLO."""
    ratio = round(admitted_run["admitted"] / capacity, 2) if capacity else None
    return ratio, bool(ratio is not None and 0.8 <= ratio <= 1.0 and admitted_run["meets_slo"])


def run_box(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    result: dict[str, Any] = {
        "cpu": _lscpu(),
        "serve_args": args.serve_args,
        "fps": args.fps,
        "window_chunks": args.window,
        "max_tokens": args.max_tokens,
        "seconds_per_level": args.seconds,
        "slo": f"p99 <= {1e3 / args.fps:.0f} ms and >= {SLO_ANSWERED:.0%} of offered frames answered",
    }
    off = [*args.serve_args, "--compute-headroom", "0"]
    with Server(args.port, off, tmp / f"camera-box-off-{os.getpid()}.log") as srv:
        result["dtype"] = (srv.lines("dtype: ") or [None])[0]
        result["startup_s_admission_off"] = srv.startup_s
        capacity, levels = asyncio.run(_levels(srv.url, args))
    result["true_capacity"] = capacity
    # Every level tried met the SLO: the true capacity is at least this (raise --max-level).
    result["true_capacity_capped"] = capacity == args.max_level
    result["levels_admission_off"] = levels
    on = list(args.serve_args)
    if args.headroom is not None:
        on += ["--compute-headroom", str(args.headroom)]
    offered = max(2 * capacity, 2)
    with Server(args.port, on, tmp / f"camera-box-on-{os.getpid()}.log") as srv:
        result["calibration"] = srv.lines("compute: ")
        level = asyncio.run(_camera_level(srv.url, offered, _client_args(args)))
    level["meets_slo"] = meets_slo({**level, "sessions": level["admitted"]}, 1e3 / args.fps)
    print(json.dumps(level), flush=True)
    result["admission_on"] = level
    result["admitted"] = level["admitted"]
    result["admitted_over_true"], result["target_met"] = _against(level, capacity)
    with Server(args.port, off, tmp / f"camera-box-after-{os.getpid()}.log") as srv:
        after, after_levels = asyncio.run(_capacity_near(srv.url, level["admitted"], args))
    result["true_capacity_after"] = after
    result["levels_admission_off_after"] = after_levels
    result["admitted_over_true_after"], result["target_met_after"] = _against(level, after)
    result["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    return result


DTYPE_RUNS: tuple[tuple[str, list[str]], ...] = (
    ("default", []),
    ("float32", ["--dtype", "float32"]),
    ("bfloat16", ["--dtype", "bfloat16"]),
)


def run_dtype_check(args: argparse.Namespace) -> dict[str, Any]:
    """One camera on serve's own dtype choice, then on each dtype it chooses between, back to
    back: whether serve's choice is this CPU's faster one, not only that it is float32."""
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    result: dict[str, Any] = {"cpu": _lscpu(), "serve_args": args.serve_args}
    for name, extra in DTYPE_RUNS:
        log = tmp / f"dtype-check-{name}-{os.getpid()}.log"
        with Server(args.port, [*args.serve_args, *extra], log) as srv:
            run = {"dtype": (srv.lines("dtype: ") or [None])[0], "startup_s": srv.startup_s}
            run.update(asyncio.run(_camera_level(srv.url, 1, _client_args(args))))
        print(json.dumps({name: run}), flush=True)
        result[name] = run
    result.update(_dtype_verdict(result))
    return result


def _dtype_verdict(result: dict[str, Any]) -> dict[str, Any]:
    """The ratios of the p50s, and which explicit dtype answered faster here."""
    p50 = {name: result[name]["p50_ms"] for name, _ in DTYPE_RUNS}
    ratios = {
        f"default_over_{name}_p50": round(p50["default"] / p50[name], 3)
        if p50["default"] and p50[name]
        else None
        for name in ("float32", "bfloat16")
    }
    to_float32 = ratios["default_over_float32_p50"]
    faster = None
    if p50["float32"] and p50["bfloat16"]:
        faster = "float32" if p50["float32"] <= p50["bfloat16"] else "bfloat16"
    line = result["default"]["dtype"] or ""
    chosen = line.partition("dtype: ")[2].split(" ", 1)[0].rstrip(",")
    return {
        **ratios,
        "within_10_percent": to_float32 is not None and abs(to_float32 - 1) <= 0.10,
        "faster_dtype": faster,
        "serve_chose_faster": faster is not None and faster == chosen,
    }


def _dtype_check_line(result: dict[str, Any]) -> str:
    """The check in one line (CI prints it last, where its log's tail shows it)."""
    cpu = result["cpu"]
    runs = [
        f"{name}: {result[name]['dtype']}; p50 {result[name]['p50_ms']} ms, "
        f"p99 {result[name]['p99_ms']} ms, {result[name]['answered_share']} answered"
        for name, _ in DTYPE_RUNS
    ]
    return (
        f"dtype-check on {cpu.get('model')} ({cpu.get('cpus')} CPUs; {' '.join(cpu.get('flags', []))}): "
        + " | ".join(runs)
        + f" | default / float32 p50 {result['default_over_float32_p50']}"
        + f", default / bfloat16 p50 {result['default_over_bfloat16_p50']}"
        + f" | faster here: {result['faster_dtype']}, serve chose it: {result['serve_chose_faster']}"
    )


def _run_mode(args: argparse.Namespace) -> dict[str, Any]:
    """The mode the flags name, with its defaults."""
    if args.startup:
        start = one_start(args.serve_args, args.port, args.cwd, 900.0)
        return {"commit": _commit(args.cwd), "serve_args": args.serve_args, "run": start}
    if args.dtype_check:
        args.seconds = args.seconds or 30.0
        args.warmup = 5.0 if args.warmup is None else args.warmup
        return run_dtype_check(args)
    if args.box:
        args.seconds = args.seconds or (20.0 if args.quick else 60.0)
        args.warmup = 5.0 if args.warmup is None else args.warmup
        if args.quick:
            args.seconds = min(args.seconds, 20.0)
            args.max_level = min(args.max_level, 6)
        return run_box(args)
    if args.camera:
        args.seconds = args.seconds or 30.0
        args.warmup = args.warmup or 0.0
        args.levels = args.levels or [1, 4, 8, 12, 16, 20]
        return asyncio.run(camera(args))
    return asyncio.run(run(args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument(
        "--frame-text-tokens",
        type=int,
        default=32,
        help="video: the sessions' limits.max_chunk_tokens (a frame's prompt, template included)",
    )
    parser.add_argument("--chunks", type=int, default=100)
    parser.add_argument("--window", type=int, default=4, help="window_chunks of every session")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="KV block size (default: vLLM's for the device)",
    )
    parser.add_argument(
        "--pool-blocks",
        type=int,
        default=None,
        help="size the KV pool to this many blocks (fp32); default: vLLM's default KV size",
    )
    parser.add_argument("--stall-s", type=float, default=120.0)
    parser.add_argument("--camera", default=None, help="camera capacity against this server URL")
    parser.add_argument("--levels", type=lambda v: [int(x) for x in v.split(",")], default=None)
    parser.add_argument(
        "--seconds", type=float, default=None, help="camera: seconds per level (30; --box: 60)"
    )
    parser.add_argument("--fps", type=float, default=1.0, help="camera: frames offered per second")
    parser.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="camera: seconds at the start of each level not measured (0; --box: 5)",
    )
    parser.add_argument(
        "--declare", action="store_true", help="camera: open with the page's limits"
    )
    parser.add_argument(
        "--box", action="store_true", help="the camera box (true capacity, admitted)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="--box: 20 s a level, 6 levels at most"
    )
    parser.add_argument("--max-level", type=int, default=40, help="--box: most cameras tried")
    parser.add_argument("--headroom", type=float, default=None, help="--box: default serve's")
    parser.add_argument("--port", type=int, default=8031, help="--box, --startup: serve's port")
    parser.add_argument("--startup", action="store_true", help="time serve's start-up")
    parser.add_argument(
        "--dtype-check",
        action="store_true",
        help="one camera: serve's dtype against float32 and bfloat16",
    )
    parser.add_argument("--cwd", type=Path, default=Path.cwd(), help="--startup: the checkout")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("serve_args", nargs="*", help="--box, --startup: after --, serve's flags")
    args = parser.parse_args()
    result = _run_mode(args)
    out = json.dumps(result, indent=2)
    print(out)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(out + "\n")
    if args.dtype_check:
        print(_dtype_check_line(result), flush=True)


if __name__ == "__main__":
    main()
