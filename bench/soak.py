"""Soak and load through the real server (uvicorn on loopback, WebSocket clients, real vLLM).

    .venv/bin/python -m bench.soak soak --frames 10000 --max-seconds 600
    .venv/bin/python -m bench.soak load --sessions 32 --frames 100

`soak`: ONE text session on SmolLM2-135M with retention (sink 1 chunk, window 4 chunks): frame
after frame, it records the reply latency, the KV blocks the session holds and the resident
memory of the server process, the EngineCore and its worker; it reports their slopes (a bounded
session has ~0 slope) and the latency of the first and last tenth. Bounded by `--frames` and
`--max-seconds`, whichever comes first. Every `--heap-every` frames it also reads, in EngineCore
and the worker, glibc's bytes in use vs free (`mallinfo2`) and the live Python objects, which
tell a leak from allocator retention; `--trace` adds tracemalloc (all three processes) from the
warm-up tenth on and reports the allocation sites that grew most. `--control N` is the same
traffic without retention, a fresh (unbounded) session every N frames: vLLM's own growth.

`load`: `--sessions` concurrent video sessions × `--frames` frames on the tiny VLM: every reply
must carry its own session's frame_id, no error, and every KV block back after.

Prints one JSON document (and writes it with `--json`).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import os
import socket
import statistics
import sys
import time
import tracemalloc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 for fewer than two points)."""
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 0.0 if den == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den


def _quantiles(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        return {"p50": values[0] if values else 0.0, "p99": values[0] if values else 0.0}
    q = statistics.quantiles(values, n=100)
    return {"p50": round(q[49], 2), "p90": round(q[89], 2), "p99": round(q[98], 2)}


@contextlib.asynccontextmanager
async def serve(settings: Any, model_name: str, **config: Any) -> AsyncIterator[dict[str, Any]]:
    """Engine + server in this process; yields url, hub, engine processes."""
    import psutil
    import uvicorn

    from realtime.config import ServerConfig
    from realtime.engine import start_engine
    from realtime.hub import SessionHub
    from realtime.server import WS_IMPLEMENTATION, create_app

    engine = start_engine(settings)
    manager = engine.engine_core.resources.engine_manager
    cores = [psutil.Process(p.pid) for p in manager.processes]
    procs = cores + [c for p in cores for c in p.children(recursive=True)]
    port = _free_port()
    cfg = ServerConfig(port=port, **config)
    holder: dict[str, SessionHub] = {}

    async def hub_factory() -> SessionHub:
        hub = SessionHub(engine, cfg, model_name=model_name)
        await hub.start()
        holder["hub"] = hub
        return hub

    app = create_app(hub_factory, cfg)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", ws=WS_IMPLEMENTATION)
    )
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(600):
            if server.started:
                break
            await asyncio.sleep(0.1)
        assert server.started, "server did not start"
        yield {
            "url": f"ws://127.0.0.1:{port}/v1/realtime",
            "hub": holder["hub"],
            "engine": engine,
            "processes": procs,
        }
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, timeout=30)
        engine.shutdown()


def _rss(procs: list[Any]) -> dict[str, int]:
    import psutil

    out = {"server": psutil.Process().memory_info().rss}
    for i, p in enumerate(procs):
        with contextlib.suppress(psutil.Error):
            out["engine_core" if i == 0 else f"engine_child{i}"] = p.memory_info().rss
    return out


async def _recv_until(ws: Any, kind: str, timeout: float = 300) -> list[dict[str, Any]]:
    seen = []
    while True:
        ev = json.loads(await asyncio.wait_for(ws.recv(), timeout))
        seen.append(ev)
        if ev["type"] == kind:
            return seen


async def _pool(hub: Any) -> tuple[int, int]:
    from retention.vllm_adapter.introspect import kv_stats

    stats = await kv_stats(hub.engine)
    return int(stats["num_free_blocks"]), int(stats["num_usable_blocks"])


async def _wait_pool_free(hub: Any, timeout: float = 60) -> int:
    free, usable = await _pool(hub)
    deadline = time.monotonic() + timeout
    while (free != usable or hub.sessions) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        free, usable = await _pool(hub)
    return usable - free  # blocks still held (leaked)


def _engine_settings(model: str, **over: Any) -> Any:
    from realtime.engine import EngineSettings

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    base: dict[str, Any] = {
        "max_model_len": 1024,
        "kv_cache_memory_bytes": 48 << 20,
        "block_size": 32,
        "dtype": "float32",
    }
    return EngineSettings(model=model, **{**base, **over})


async def _soak_frame(ws: Any, i: int) -> dict[str, Any]:
    """Send frame i, wait for its response.done; its latency and retention figures."""
    text = f"Reading {i}: the meter shows {(i * 7919) % 1000}. Is it high?"
    sent = time.perf_counter()
    await ws.send(json.dumps({"type": "frame.append", "text": text}))
    seen = await _recv_until(ws, "response.done")
    latency = (time.perf_counter() - sent) * 1e3
    done = seen[-1]
    errors = [e for e in seen if e["type"] == "error"]
    if errors or done["status"] not in ("completed", "incomplete"):
        raise RuntimeError(f"frame {i}: {done} {errors}")
    return {
        "i": i,
        "latency_ms": latency,
        "kv_blocks": done["retention"]["kv_blocks_held"],
        "tokens": done["retention"]["tokens_retained"],
        "evicted": done["retention"]["frames_evicted"],
        "consolidations": done["retention"]["consolidations"],
    }


async def _heap_end(
    engine: Any, local_baseline: tracemalloc.Snapshot | None, trace: bool
) -> dict[str, Any]:
    from retention.vllm_adapter.diagnostics import heap_stats

    heap_end = await heap_stats(engine, "types")
    if trace:
        heap_end["trace"] = await heap_stats(engine, "trace_top")
    if local_baseline is not None:
        diffs = tracemalloc.take_snapshot().compare_to(local_baseline, "traceback")
        heap_end["server_trace_top"] = [
            {"stack": [str(f) for f in d.traceback], "size_diff": d.size_diff} for d in diffs[:15]
        ]
        tracemalloc.stop()
    return heap_end


async def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    import websockets

    from retention.vllm_adapter.diagnostics import heap_stats

    # Heap diagnostics are installed only on request (the engine's introspection setting).
    settings = _engine_settings(
        "smollm2-135m-instruct", max_num_seqs=4, introspection=bool(args.heap_every or args.trace)
    )
    records: list[dict[str, Any]] = []
    warm_frame = args.frames // 10
    types_at_warm: dict[str, Any] = {}
    heap_end: dict[str, Any] = {}
    local_baseline: tracemalloc.Snapshot | None = None
    started = time.perf_counter()
    async with serve(settings, "smollm2-135m-instruct", max_sessions=2) as srv:
        hub = srv["hub"]
        free0, usable = await _pool(hub)
        retention = None if args.control else {"sink_chunks": 1, "window_chunks": args.window}
        per_session = args.control or args.frames
        t0 = time.perf_counter()
        i = 0
        while i < args.frames and time.perf_counter() - t0 <= args.max_seconds:
            last = min(args.frames, i + per_session)
            async with websockets.connect(srv["url"], subprotocols=["vllm-realtime"]) as ws:
                await ws.recv()
                opening: dict[str, Any] = {
                    "type": "session.open",
                    "modality": "text",
                    "instructions": "Answer with one word.",
                    "sampling": {"max_tokens": args.max_tokens},
                }
                if retention is not None:
                    opening["retention"] = retention
                await ws.send(json.dumps(opening))
                opened = json.loads(await ws.recv())
                assert opened["type"] == "session.opened", opened
                while i < last and time.perf_counter() - t0 <= args.max_seconds:
                    records.append(await _soak_frame(ws, i))
                    rec = records[-1]
                    if i % args.rss_every == 0:
                        rec["rss"] = _rss(srv["processes"])
                    if args.heap_every and i % args.heap_every == 0:
                        rec["heap"] = _heap_row(await heap_stats(srv["engine"]))
                    if i == warm_frame and (args.heap_every or args.trace):
                        await heap_stats(srv["engine"], "steps_start")
                        types_at_warm = await heap_stats(srv["engine"], "types")
                        if args.trace:
                            await heap_stats(srv["engine"], "trace_start")
                            tracemalloc.start(8)  # this process: server and soak client
                            local_baseline = tracemalloc.take_snapshot()
                    i += 1
                diagnostics = bool(args.heap_every or args.trace)
                if diagnostics and (
                    i >= args.frames or time.perf_counter() - t0 > args.max_seconds
                ):
                    # Before the last close: the session's own state is still live here.
                    heap_end = await _heap_end(srv["engine"], local_baseline, args.trace)
                await ws.send(json.dumps({"type": "session.close"}))
                with contextlib.suppress(websockets.exceptions.ConnectionClosed):
                    await _recv_until(ws, "session.closed")
        leaked = await _wait_pool_free(hub)
    pool = {"usable_blocks": usable, "free_before": free0, "leaked_after_close": leaked}
    summary = _summary(records, types_at_warm, heap_end)
    return {
        "mode": "soak",
        "frames": len(records),
        "seconds": round(time.perf_counter() - started, 1),
        "retention": retention,
        "frames_per_session": per_session,
        **summary,
        "pool": pool,
    }


def _summary(
    records: list[dict[str, Any]], types_at_warm: dict[str, Any], heap_end: dict[str, Any]
) -> dict[str, Any]:
    """What the frames' records say: KV, RSS and heap slopes after the warm-up tenth, latency."""
    n = len(records)
    warm = records[n // 10 :] or records  # skip the warm-up tenth
    xs = [float(r["i"]) for r in warm]
    tenth = max(1, n // 10)
    rss_slopes, rss_first_last = _per_1k_and_ends(warm, "rss")
    heap_slopes, heap_first_last = _per_1k_and_ends(warm, "heap")
    return {
        "kv_blocks": {
            "min": min(r["kv_blocks"] for r in records),
            "max": max(r["kv_blocks"] for r in records),
            "slope_per_1k_frames": round(slope(xs, [r["kv_blocks"] for r in warm]) * 1000, 3),
        },
        "tokens_retained_max": max(r["tokens"] for r in records),
        "frames_evicted": records[-1]["evicted"],
        "consolidations": records[-1]["consolidations"],
        "rss_bytes_per_1k_frames": rss_slopes,
        "rss_first_last": rss_first_last,
        "heap_bytes_per_1k_frames": heap_slopes,
        # Every sample, to see whether growth levels off: [frame, worker in use, RSS, step sizes].
        "heap_series": [
            [
                r["i"],
                r["heap"].get("worker0.malloc_in_use"),
                r["heap"].get("worker0.rss"),
                r["heap"].get("worker0.distinct_step_sizes"),
            ]
            for r in records
            if "heap" in r
        ],
        "heap_first_last": heap_first_last,
        "object_types": _type_growth(types_at_warm, heap_end),
        "trace_top": {
            "engine_core": heap_end.get("trace", {}).get("engine_core", {}).get("trace_top"),
            "workers": [w.get("trace_top") for w in heap_end.get("trace", {}).get("workers", [])],
            "server": heap_end.get("server_trace_top"),
        },
        "latency_ms": {
            "first_tenth": _quantiles([r["latency_ms"] for r in records[:tenth]]),
            "last_tenth": _quantiles([r["latency_ms"] for r in records[-tenth:]]),
            "slope_ms_per_1k_frames": round(slope(xs, [r["latency_ms"] for r in warm]) * 1000, 2),
        },
    }


def _per_1k_and_ends(
    records: list[dict[str, Any]], key: str
) -> tuple[dict[str, int], dict[str, list[int]]]:
    """For the records sampled under `key` ("rss" or "heap"): each figure's slope per 1,000
    frames, and its first and last value."""
    rows = [r for r in records if key in r]
    names = rows[0][key] if rows else {}
    xs = [float(r["i"]) for r in rows]
    slopes = {n: round(slope(xs, [r[key][n] for r in rows]) * 1000) for n in names}
    ends = {n: [rows[0][key][n], rows[-1][key][n]] for n in names}
    return slopes, ends


def _heap_row(stats: dict[str, Any]) -> dict[str, int]:
    """Flatten heap_stats into numbers: per process, RSS, malloc in use / free, Python objects."""
    row: dict[str, int] = {}
    procs = [("engine_core", stats["engine_core"])] + [
        (f"worker{i}", w) for i, w in enumerate(stats["workers"])
    ]
    for name, st in procs:
        row[f"{name}.rss"] = int(st["rss_bytes"] or 0)
        row[f"{name}.objects"] = int(st["python_objects"])
        if "distinct_step_sizes" in st:
            row[f"{name}.distinct_step_sizes"] = int(st["distinct_step_sizes"])
        if st["malloc"]:
            row[f"{name}.malloc_in_use"] = st["malloc"]["in_use"]
            row[f"{name}.malloc_free"] = st["malloc"]["free_in_arenas"]
    return row


def _type_growth(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Per process: object counts of the most common types at warm-up and at the end."""
    out: dict[str, Any] = {}
    pairs = [("engine_core", before.get("engine_core"), after.get("engine_core"))]
    pairs += [
        (f"worker{i}", b, a)
        for i, (b, a) in enumerate(
            zip(before.get("workers", []), after.get("workers", []), strict=False)
        )
    ]
    for name, b, a in pairs:
        if not b or not a or "types" not in b or "types" not in a:
            continue
        names = sorted(set(b["types"]) | set(a["types"]))
        out[name] = {
            t: [b["types"].get(t), a["types"].get(t)]
            for t in names
            if b["types"].get(t) != a["types"].get(t)
        }
    return out


def _jpeg(seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (112, 112, 3), dtype=np.uint8)).save(buf, "JPEG")
    return buf.getvalue()


async def run_load(args: argparse.Namespace) -> dict[str, Any]:
    import websockets

    settings = _engine_settings(
        "tiny-qwen2-vl",
        # Sessions get the default retention (sink 1 chunk, window 8 chunks).
        max_model_len=4096,
        kv_cache_memory_bytes=max(180, 5 * args.sessions) << 20,
        max_num_seqs=max(48, args.sessions),
        extra={"limit_mm_per_prompt": {"image": 1, "video": 1}},
    )
    images = [_jpeg(i) for i in range(8)]
    latencies: list[float] = []
    problems: list[str] = []
    async with serve(settings, "tiny-qwen2-vl", max_sessions=args.sessions + 8) as srv:
        hub = srv["hub"]

        async def one(n: int) -> None:
            token = f"conn{n:03d}"
            async with websockets.connect(srv["url"], subprotocols=["vllm-realtime"]) as ws:
                await ws.recv()
                await ws.send(json.dumps({"type": "session.open", "sampling": {"max_tokens": 4}}))
                opened = json.loads(await ws.recv())
                if opened["type"] != "session.opened":
                    problems.append(f"{token}: {opened}")
                    return
                for i in range(args.frames):
                    fid = f"{token}-{i}"
                    sent = time.perf_counter()
                    if i % 2:
                        await ws.send(
                            json.dumps({"type": "frame.append", "binary": True, "frame_id": fid})
                        )
                        await ws.send(images[(n + i) % 8])
                    else:
                        image = base64.b64encode(images[(n + i) % 8]).decode()
                        await ws.send(
                            json.dumps({"type": "frame.append", "image": image, "frame_id": fid})
                        )
                    seen = await _recv_until(ws, "response.done")
                    latencies.append((time.perf_counter() - sent) * 1e3)
                    for ev in seen:
                        if ev["type"] == "error":
                            problems.append(f"{fid}: {ev['error']}")
                        elif ev.get("frame_index", i) != i or ev.get("frame_id", fid) != fid:
                            problems.append(f"{fid}: wrong reply {ev}")
                await ws.send(json.dumps({"type": "session.close"}))
                with contextlib.suppress(websockets.exceptions.ConnectionClosed):
                    await _recv_until(ws, "session.closed")

        t0 = time.perf_counter()
        await asyncio.gather(*(one(n) for n in range(args.sessions)))
        elapsed = time.perf_counter() - t0
        leaked = await _wait_pool_free(hub)
    return {
        "mode": "load",
        "sessions": args.sessions,
        "frames_per_session": args.frames,
        "frames": len(latencies),
        "seconds": round(elapsed, 1),
        "frames_per_s": round(len(latencies) / elapsed, 1),
        "latency_ms": _quantiles(latencies),
        "problems": problems[:20],
        "problem_count": len(problems),
        "blocks_leaked": leaked,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    soak = sub.add_parser("soak")
    soak.add_argument("--frames", type=int, default=10_000)
    soak.add_argument("--max-seconds", type=float, default=600.0)
    soak.add_argument("--window", type=int, default=4)
    soak.add_argument("--max-tokens", type=int, default=4)
    soak.add_argument("--rss-every", type=int, default=25)
    soak.add_argument(
        "--heap-every", type=int, default=250, help="malloc/object sampling period; 0: off"
    )
    soak.add_argument(
        "--control",
        type=int,
        default=0,
        help="control run: no retention, a new session every N frames (0: one bounded session)",
    )
    soak.add_argument(
        "--trace", action="store_true", help="tracemalloc from warm-up on (slow; diagnostics)"
    )
    load = sub.add_parser("load")
    load.add_argument("--sessions", type=int, default=32)
    load.add_argument("--frames", type=int, default=100)
    for p in (soak, load):
        p.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    result = asyncio.run(run_soak(args) if args.mode == "soak" else run_load(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    ok = result.get("blocks_leaked", result.get("pool", {}).get("leaked_after_close", 0)) == 0
    return 0 if ok and not result.get("problem_count") else 1


if __name__ == "__main__":
    sys.exit(main())
