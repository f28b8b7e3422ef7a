"""Tail latency of bounded sessions across consolidations (issue #21), old and new behaviour.

    .venv/bin/python -m bench.tail_latency                      # the full run (3,000 + 1,000)
    .venv/bin/python -m bench.tail_latency --text-frames 600 --video-frames 300   # a short one

For each model (SmolLM2-135M text turns, then the tiny Qwen2-VL with 112×112 image frames) and
each mode, one engine and ONE bounded session on the server's own path (`EngineSession`,
`render_chunk`), frames paced by a client clock (`--period-ms`: a frame every period, or at
once when the previous one ended late; or `--gap-ms` of idle time after each reply), every frame answered (`--max-tokens`, EOS ignored):

* `rotate` (the default on 1D-RoPE models since session 10): a consolidation rotates the
  window's cached keys to 0..n-1 in place, on the fold of the frame that needs it, with no
  model step (`retention/vllm_adapter/kv_rotation.py`). mRoPE models cannot rotate: their
  sessions re-prefill (as `idle`);
* `idle`: a re-prefill while the session is idle (a control chunk after the boundary whose
  report asks for it, when the client's gaps leave the time), in pieces of repeating sizes;
* `inline` (the behaviour before issue #21): every consolidation re-prefilled on the path of
  the frame that needs it, in one step (the engine's re-prefill piece 0, `--reprefill-piece 0`).

`--max-position` is set low enough for many consolidations. Reported per run: p50/p90/p99 of
the per-frame latency (the chunk sent → its boundary, what `response.done` measures), p99/p50,
every frame over 2× p50 with what happened on it (a consolidation on its path, a wait for an
idle one still running), the worker's RSS slope per 1k frames (least squares after the first
tenth), its distinct step sizes (diagnostics), frames and tokens retained against the window,
the load average before and after (the machine's other load is not ours), the CPU time the
hypervisor took during the session, and the tail of a fixed unit of CPU work run on the same
clock just before and after it (`probe`: the machine's own floor). Prints one JSON
document and writes it with `--json`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.report import emit_json, trace_summary
from bench.soak import slope
from retention.vllm_adapter.shm_prefault import PREFAULT_BYTES_PER_CHUNK, SHM_PREFAULT_ENV

TEXT_MODEL = "smollm2-135m-instruct"
VIDEO_MODEL = "tiny-qwen2-vl"
# The default model of `make run` since session 17: the same frames through a 135M LM.
SMOL_VIDEO_MODEL = "smol-qwen2-vl"
MQ_CHUNK_ENV = "VLLM_MQ_MAX_CHUNK_BYTES_MB"  # vLLM's step-ring chunk size, read by EngineCore
# vLLM's CPU platform turns "uni" into "mp" (a worker process); naming the class keeps the
# worker inside EngineCore (docs/history/benchmarks-2026.md, session 17).
EXECUTORS = {"mp": "mp", "uni": "vllm.v1.executor.uniproc_executor.UniProcExecutor"}


# ------------------------------------------------------------------ the machine's own tail
# A frame of the video session is ~20 ms of work every 300 ms. On a shared virtual machine the
# same fixed work, with nothing of ours running, has a tail of its own (slow bursts of seconds,
# cold caches after each sleep), and no serving code can be flatter than that. `probe` runs a
# fixed ~10 ms unit of single-threaded CPU work on the frame clock before and after each
# session, in a process of its own with one thread, so that a session's p99/p50 can be read
# beside the machine's at that hour.


def cpu_steal_jiffies() -> int | None:
    """Time the hypervisor gave this machine's CPUs to others (all CPUs, clock ticks)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8])
    except (OSError, IndexError, ValueError):
        return None


def _unit(a: Any) -> float:
    # Matrix products and Python bytecode: both halves of what a frame does on the CPU.
    s = 0.0
    for _ in range(20):
        s += float((a @ a).sum())
    return s + sum(i * i for i in range(30_000))


def measure(seconds: float, period_s: float) -> dict[str, Any]:
    """Run the unit every `period_s` for `seconds`, in this process."""
    import numpy as np

    a = np.random.default_rng(0).random((256, 256), dtype=np.float32)
    _unit(a)  # warm
    took: list[float] = []
    steal0 = cpu_steal_jiffies()
    end = time.perf_counter() + seconds
    next_at = time.perf_counter()
    while time.perf_counter() < end:
        now = time.perf_counter()
        if now < next_at:
            time.sleep(next_at - now)
        next_at = max(now, next_at) + period_s
        t0 = time.perf_counter()
        _unit(a)
        took.append((time.perf_counter() - t0) * 1e3)
    steal1 = cpu_steal_jiffies()
    # The percentiles bench.tail_latency reports for frames, so that the two ratios compare.
    q = statistics.quantiles(took, n=100, method="inclusive") if len(took) > 1 else took * 99
    return {
        "seconds": seconds,
        "period_ms": round(period_s * 1e3, 1),
        "units": len(took),
        "p50_ms": round(q[49], 2),
        "p90_ms": round(q[89], 2),
        "p99_ms": round(q[98], 2),
        "p99_over_p50": round(q[98] / q[49], 3),
        "steal_jiffies": None if steal0 is None or steal1 is None else steal1 - steal0,
    }


def probe(seconds: float, period_s: float) -> dict[str, Any]:
    """`measure` in a fresh single-threaded process (not the caller's threads or heap)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    code = "import json, sys; from bench.tail_latency import measure; " + (
        "print(json.dumps(measure(float(sys.argv[1]), float(sys.argv[2]))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(seconds), str(period_s)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def quantiles(values: list[float]) -> dict[str, float]:
    if len(values) < 2:
        values = [*values, *values] or [0.0, 0.0]  # statistics.quantiles needs two points
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": round(q[49], 2), "p90": round(q[89], 2), "p99": round(q[98], 2)}


def pin_front(cpus: set[int]) -> None:
    """Every thread of this process (the front end) and of its children (EngineCore) onto
    `cpus`; the worker, EngineCore's child, keeps its own binding. Affinity is per thread on
    Linux, so each task is set."""
    me = os.getpid()
    pids = [me]
    for task in Path(f"/proc/{me}/task").iterdir():
        children = (task / "children").read_text().split()
        pids += [int(c) for c in children]
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(int(task.name), cpus)


def loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


@dataclass
class _Run:
    """What one session's run collects, frame by frame."""

    records: list[dict[str, Any]] = field(default_factory=list)
    rss: list[tuple[int, int]] = field(default_factory=list)
    # (frame, bytes by kind): "anon", "file" (mapped files) and "shmem" (shared memory).
    rss_split: list[tuple[int, dict[str, int]]] = field(default_factory=list)
    # --rss-after-trim: (frame, RSS, malloc bytes in use) read right after a malloc_trim(0).
    rss_trimmed: list[tuple[int, int, int]] = field(default_factory=list)
    consolidation_s: list[float] = field(default_factory=list)
    heap_at_tenth: dict[str, Any] = field(default_factory=dict)
    seen_idle: int = 0
    first_tokens: int = 0
    front_gc: list[tuple[float, float, int]] = field(default_factory=list)
    # Read at the end, engine still up: see _read_end.
    end: dict[str, Any] = field(default_factory=dict)


def _settings(args: argparse.Namespace, model: str, executor: str | None) -> Any:
    from realtime.engine import EngineSettings

    video = model in (VIDEO_MODEL, SMOL_VIDEO_MODEL)
    extra: dict[str, Any] = {"limit_mm_per_prompt": {"image": 1, "video": 0}} if video else {}
    if executor is not None:
        extra["distributed_executor_backend"] = EXECUTORS[executor]
    return EngineSettings(
        model=model,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=args.kv_mib << 20,
        block_size=args.block_size,
        max_num_seqs=4,
        dtype="float32",
        # heap_stats (timeline, trim_read, step sizes), worker_stats and retention_state.
        introspection=True,
        extra=extra,
    )


def _budget(args: argparse.Namespace, video: bool, mode: str) -> dict[str, Any]:
    return {
        "sink_chunks": 1,
        "window_chunks": args.window,
        "max_position": args.video_max_position if video else args.text_max_position,
        "consolidation": "rotate" if mode == "rotate" else "reprefill",
    }


def _machine(args: argparse.Namespace) -> dict[str, Any]:
    """The machine's state around a session: noise probe, load average, CPU steal."""
    noise = probe(args.noise_probe_s, args.period_ms / 1e3) if args.noise_probe_s else None
    return {"noise": noise, "load": loadavg(), "steal": cpu_steal_jiffies()}


async def run_session(
    args: argparse.Namespace, model: str, mode: str, executor: str | None = None
) -> dict[str, Any]:
    from realtime.engine import start_engine

    video = model in (VIDEO_MODEL, SMOL_VIDEO_MODEL)
    frames = args.video_frames if video else args.text_frames
    # Read by the engine processes at start-up (they inherit this environment).
    budget = _budget(args, video, mode)
    before = _machine(args)
    settings = _settings(args, model, executor)
    # The engine's re-prefill piece (its settings, `serve --reprefill-piece`); inline: one step.
    engine = start_engine(
        settings.with_overrides(reprefill_piece=0 if mode == "inline" else args.piece)
    )
    if args.pin_front:
        # The CPU-list syntax of VLLM_CPU_OMP_THREADS_BIND, parsed by vLLM's own parser.
        from vllm.utils.cpu_resource_utils import parse_id_list

        pin_front(set(parse_id_list(args.pin_front)))
    run = _Run()
    started = time.perf_counter()
    try:
        await _stream(engine, args, run, mode, budget, video, frames)
    finally:
        engine.shutdown()
    seconds = time.perf_counter() - started
    after = _machine(args)
    if args.records is not None:
        with args.records.open("a") as out:
            for r in run.records:
                out.write(json.dumps({"model": model, "mode": mode} | r) + "\n")
    return (
        {"model": model, "mode": mode, "frames": len(run.records), "seconds": round(seconds, 1)}
        | _settings_summary(args, mode, budget, run.end["final"])
        | _latency_summary(args, run, before, after)
        | {
            "worker_rss": _worker_rss(args, run, frames),
            "worker_step_sizes": run.end["steps"],
            "worker_heap": run.end["heap"],
            # --trace: Python allocation sites grown most since the first tenth (tracemalloc).
            "worker_trace_top": run.end["trace_top"],
            "retained": _retained(args, run),
        }
    )


async def _stream(
    engine: Any,
    args: argparse.Namespace,
    run: _Run,
    mode: str,
    budget: dict[str, Any],
    video: bool,
    frames: int,
) -> None:
    """The session: `frames` frames on the frame clock, then what the engine says at the end."""
    from bench.driver import image_frame, text_frame
    from realtime.engine_session import EngineSession, chat_format_of, render_chunk
    from retention.vllm_adapter.diagnostics import heap_stats, watch_gc
    from vllm_realtime_protocol import SamplingConfig, SessionConfig

    if args.timeline:
        await heap_stats(engine, "timeline_start")
        watch_gc(run.front_gc)
    es = EngineSession(
        engine,
        f"tail-{mode}-{uuid.uuid4().hex[:8]}",
        SamplingConfig(max_tokens=args.max_tokens, temperature=0.0),
        budget,
        ignore_eos=True,
        idle_consolidation=mode != "inline",
    )
    config = SessionConfig(
        modality="video" if video else "text",
        instructions="You watch a camera. Answer in one short sentence.",
    )
    chat = chat_format_of(engine)
    period = args.period_ms / 1e3
    next_send = time.perf_counter()
    for i in range(frames):
        frame = image_frame(i, size=112) if video else text_frame(i)
        prompt = await asyncio.to_thread(
            render_chunk,
            frame,
            config,
            first=es.chunks == 0,
            multimodal=video,
            after_reply=es.turn_open,
            chat=chat,
        )
        now = time.perf_counter()
        if now < next_send:
            await asyncio.sleep(next_send - now)
        next_send = max(now, next_send) + period
        await _frame(es, run, i, prompt)
        if args.gap_ms is not None:
            # Idle time after each reply instead of a fixed frame clock.
            next_send = time.perf_counter() + args.gap_ms / 1e3
        await _sample_memory(engine, args, run, i, frames)
    run.end = await _read_end(engine, args, run, es)
    await es.abort()


async def _frame(es: Any, run: _Run, i: int, prompt: Any) -> None:
    """Send frame `i`, wait for its reply, record its latency and the session's state."""
    from realtime.engine_session import ChunkFinished

    params = es.chunk_params(reply=True)
    before = es.last_report
    cons_before = before.retention.consolidations if before and before.retention else 0
    idle_before = es.idle_consolidations
    waited = es.consolidating
    t0 = time.perf_counter()
    wall0 = time.time()
    finished: ChunkFinished | None = None
    async for item in es.run_chunk(prompt, params):
        if isinstance(item, ChunkFinished):
            finished = item
    latency = (time.perf_counter() - t0) * 1e3
    assert finished is not None and finished.report is not None
    report = finished.report
    counters = report.retention
    assert counters is not None, report
    idle_during = es.idle_consolidations - idle_before
    if es.idle_consolidations > run.seen_idle and es.last_consolidation_s is not None:
        run.consolidation_s.append(es.last_consolidation_s)  # at most one per gap
    run.seen_idle = es.idle_consolidations
    inline = counters.consolidations - cons_before - idle_during
    if i == 0:
        run.first_tokens = report.tokens_in_context
    run.records.append(
        {
            "i": i,
            "latency_ms": round(latency, 2),
            "wall": (wall0, time.time()),
            "ttft_ms": finished.ttft_ms,
            "prompt_tokens": finished.prompt_tokens,
            "inline_consolidation": inline > 0,
            "waited_for_idle_consolidation": waited,
            "chunks_retained": counters.chunks_retained,
            "tokens_in_context": report.tokens_in_context,
            "kv_blocks": report.kv_blocks_held,
            "consolidations": counters.consolidations,
        }
    )


async def _sample_memory(
    engine: Any, args: argparse.Namespace, run: _Run, i: int, frames: int
) -> None:
    from retention.vllm_adapter.diagnostics import heap_stats
    from retention.vllm_adapter.introspect import worker_stats

    # RSS first: the heap probe below lists every Python object of the worker (~6 MB at 700k
    # objects), which a sample taken after it would count at the first tenth.
    if i % args.rss_every == 0 or i == frames - 1:
        workers = await worker_stats(engine)
        run.rss.append((i, int(workers[0]["rss_bytes"])))
        run.rss_split.append((i, dict(workers[0].get("rss_split_bytes") or {})))
        if args.rss_after_trim:
            (trimmed,) = (await heap_stats(engine, "trim_read"))["workers"]
            malloc = trimmed.get("malloc") or {}
            run.rss_trimmed.append((i, int(trimmed["rss_bytes"]), malloc.get("in_use", 0)))
    if i == frames // 10:
        run.heap_at_tenth = (await heap_stats(engine, "steps_start"))["workers"][0]
        if args.trace:
            await heap_stats(engine, "trace_start")


async def _read_end(engine: Any, args: argparse.Namespace, run: _Run, es: Any) -> dict[str, Any]:
    """The worker's heap, step sizes and trace, the timeline, the session's last state."""
    from retention.vllm_adapter.diagnostics import heap_stats
    from retention.vllm_adapter.introspect import retention_state

    timeline = await _read_timeline(engine, run.front_gc) if args.timeline else {}
    stats = await heap_stats(engine, "trace_top" if args.trace else "read")
    return {
        "timeline": timeline,
        "steps": {"distinct_since_first_tenth": stats["workers"][0].get("distinct_step_sizes")},
        # malloc's bytes in use and live Python objects, first tenth vs end: tells a leak (in
        # use grows) from allocator retention (RSS grows, in use flat).
        "heap": {
            "at_first_tenth": _heap_summary(run.heap_at_tenth),
            "at_end": _heap_summary(stats["workers"][0]),
        },
        "trace_top": trace_summary(stats["workers"][0]),
        "idle_total": es.idle_consolidations,
        "idle_skipped": es.idle_consolidations_skipped,
        "final": await retention_state(engine, es.request_id) or {},
    }


def _settings_summary(
    args: argparse.Namespace, mode: str, budget: dict[str, Any], final: dict[str, Any]
) -> dict[str, Any]:
    return {
        "budget": budget,
        "block_size": args.block_size,
        "reprefill_piece": 0 if mode == "inline" else args.piece,
        "consolidation_mode": final.get("consolidation"),
        "rotations": final.get("rotations"),
        "rotation_fallbacks": final.get("rotation_fallbacks"),
        "period_ms": args.period_ms,
        "gap_ms": args.gap_ms,
        "max_tokens": args.max_tokens,
    }


def _latency_summary(
    args: argparse.Namespace, run: _Run, before: dict[str, Any], after: dict[str, Any]
) -> dict[str, Any]:
    records = run.records
    latencies = [r["latency_ms"] for r in records]
    q = quantiles(latencies)
    over = [r for r in records if r["latency_ms"] > 2 * q["p50"]]
    steal0, steal1 = before["steal"], after["steal"]
    timeline = run.end["timeline"]
    return {
        "loadavg_before": before["load"],
        "loadavg_after": after["load"],
        "cpu_steal_jiffies": None if steal0 is None or steal1 is None else steal1 - steal0,
        "latency_ms": q,
        "p99_over_p50": round(q["p99"] / q["p50"], 3),
        # The same ratio for a fixed ~10 ms unit of CPU work on the same clock, nothing of ours
        # running, just before and after this session: the machine's own floor at that hour.
        "machine_noise": {"before": before["noise"], "after": after["noise"]},
        "mean_ms": round(statistics.fmean(latencies), 2),
        "max_ms": round(max(latencies), 2),
        "consolidations": records[-1]["consolidations"],
        "idle_consolidations": run.end["idle_total"],
        # Due while idle but left to the next frame: the client's gaps were too short for it.
        "idle_consolidations_skipped": run.end["idle_skipped"],
        "idle_consolidation_ms": quantiles([x * 1e3 for x in run.consolidation_s]),
        "inline_consolidations": sum(1 for r in records if r["inline_consolidation"]),
        "frames_that_waited_for_an_idle_consolidation": sum(
            1 for r in records if r["waited_for_idle_consolidation"]
        ),
        "over_2x_p50": {
            "count": len(over),
            "with_inline_consolidation": sum(1 for r in over if r["inline_consolidation"]),
            "waited_for_idle_consolidation": sum(
                1 for r in over if r["waited_for_idle_consolidation"]
            ),
            "frames": [
                [r["i"], r["latency_ms"], r["inline_consolidation"]] for r in over[: args.list_slow]
            ],
        },
        "timeline": _explain(records, timeline, over) if timeline else None,
        "latency_on_inline_consolidation_ms": quantiles(
            [r["latency_ms"] for r in records if r["inline_consolidation"]] or [0.0, 0.0]
        ),
    }


def _worker_rss(args: argparse.Namespace, run: _Run, frames: int) -> dict[str, Any]:
    rss, rss_trimmed = run.rss, run.rss_trimmed

    def kinds(*names: str) -> list[tuple[int, int]]:
        return [(i, sum(split.get(k, 0) for k in names)) for i, split in run.rss_split]

    def slope_per_1k(samples: list[tuple[int, int]]) -> float:
        warm = [(i, b) for i, b in samples if i >= frames // 10]  # after the first tenth
        return round(slope([float(i) for i, _ in warm], [b / 2**20 for _, b in warm]) * 1000, 3)

    def mib(samples: list[tuple[int, int]]) -> list[list[float]]:
        return [[i, round(b / 2**20, 1)] for i, b in samples]

    return {
        # --timeline's step records live in the worker: ~150 B per step, in these figures.
        "includes_timeline_records": bool(args.timeline),
        "first_mb": round(rss[0][1] / 2**20, 1) if rss else None,
        "last_mb": round(rss[-1][1] / 2**20, 1) if rss else None,
        "slope_mb_per_1k_frames": slope_per_1k(rss),
        # Anonymous memory only: file-backed pages (code first touched late) are not a leak.
        "anon_slope_mb_per_1k_frames": slope_per_1k(kinds("anon")),
        # Without the shared-memory ring EngineCore writes each step into (vLLM's
        # MessageQueue: 10 chunks, each touched up to the largest message it has carried,
        # e.g. a re-prefill's pixel values): it grows in steps up to a bound, not a heap.
        "without_shmem_slope_mb_per_1k_frames": slope_per_1k(kinds("anon", "file")),
        # The trajectory: tells steady growth from a few steps (new sizes, arena growth).
        "samples_mb": mib(rss),
        "anon_samples_mb": mib(kinds("anon")),
        "file_samples_mb": mib(kinds("file")),
        "shmem_samples_mb": mib(kinds("shmem")),
        # --rss-after-trim: the same samples taken again right after the worker returned its
        # free heap to the OS, so that where a sample falls between trims does not move it.
        "after_trim": {
            "slope_mb_per_1k_frames": slope_per_1k([(i, b) for i, b, _ in rss_trimmed]),
            "malloc_in_use_slope_mb_per_1k_frames": slope_per_1k(
                [(i, u) for i, _, u in rss_trimmed]
            ),
            "samples_mb": mib([(i, b) for i, b, _ in rss_trimmed]),
            "malloc_in_use_samples_mb": mib([(i, u) for i, _, u in rss_trimmed]),
        }
        if rss_trimmed
        else None,
    }


def _retained(args: argparse.Namespace, run: _Run) -> dict[str, Any]:
    records = run.records
    per_frame = [r["prompt_tokens"] + args.max_tokens - 1 for r in records[1:]]
    frame_tokens = statistics.median(per_frame) if per_frame else 1
    held_frames = [
        (r["tokens_in_context"] - run.first_tokens) / frame_tokens
        for r in records[args.window + 2 :]
    ]
    return {
        "window_chunks": args.window,
        "sink_chunks": 1,
        # The report's chunks_retained counts the sink chunk and the chunk just answered.
        "chunks_retained_max": max(r["chunks_retained"] for r in records),
        "frames_retained_max": max(r["chunks_retained"] for r in records) - 1,
        "frame_tokens": frame_tokens,
        "frames_held_max_by_tokens": round(max(held_frames), 2) if held_frames else None,
        "tokens_in_context_max": max(r["tokens_in_context"] for r in records),
        "kv_blocks_max": max(r["kv_blocks"] for r in records),
    }


async def _read_timeline(engine: Any, front_gc: list[tuple[float, float, int]]) -> dict[str, Any]:
    from retention.vllm_adapter.diagnostics import heap_stats

    stats = await heap_stats(engine, "timeline_read")
    by_pid: dict[int, dict[str, Any]] = {}
    for proc in [stats["engine_core"], *stats["workers"]]:
        if proc.get("timeline"):
            by_pid[proc["pid"]] = proc["timeline"]  # one process when the worker is in-core
    steps = sorted(s for t in by_pid.values() for s in t["steps"])
    engine_gc = sorted(g for t in by_pid.values() for g in t["gc"])
    return {"steps": steps, "engine_gc": engine_gc, "front_gc": sorted(front_gc)}


def _explain(
    records: list[dict[str, Any]], timeline: dict[str, Any], over: list[dict[str, Any]]
) -> dict[str, Any]:
    """Per frame: the model steps that started inside it (count, seconds, tokens) and the
    garbage collections that overlapped it; the rest of its latency is outside model steps
    (scheduling, IPC, the front end). Summaries for all frames and for the slow ones."""
    import bisect

    steps = timeline["steps"]
    starts = [s[0] for s in steps]

    def overlapping(events: list[tuple[float, float, int]], a: float, b: float) -> float:
        return sum(min(b, s + d) - max(a, s) for s, d, _ in events if s < b and s + d > a)

    for r in records:
        a, b = r["wall"]
        inside = steps[bisect.bisect_left(starts, a) : bisect.bisect_left(starts, b)]
        r["steps"] = len(inside)
        r["step_ms"] = round(sum(d for _, d, _ in inside) * 1e3, 2)
        r["max_step_ms"] = round(max((d for _, d, _ in inside), default=0.0) * 1e3, 2)
        r["step_tokens"] = [n for _, _, n in inside]
        r["outside_steps_ms"] = round(r["latency_ms"] - r["step_ms"], 2)
        r["engine_gc_ms"] = round(overlapping(timeline["engine_gc"], a, b) * 1e3, 2)
        r["front_gc_ms"] = round(overlapping(timeline["front_gc"], a, b) * 1e3, 2)

    def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            key: quantiles([float(r[key]) for r in rows] or [0.0])
            for key in ("step_ms", "max_step_ms", "outside_steps_ms", "engine_gc_ms", "front_gc_ms")
        } | {"steps": quantiles([float(r["steps"]) for r in rows] or [0.0])}

    slow_ids = {r["i"] for r in over}
    return {
        "all_frames": summary(records),
        "slow_frames": summary([r for r in records if r["i"] in slow_ids]),
        "slow": [
            {
                k: r[k]
                for k in (
                    "i",
                    "latency_ms",
                    "ttft_ms",
                    "steps",
                    "step_ms",
                    "max_step_ms",
                    "step_tokens",
                    "outside_steps_ms",
                    "engine_gc_ms",
                    "front_gc_ms",
                )
            }
            for r in records
            if r["i"] in slow_ids
        ],
        # Model step time by step size (tokens): does the time vary with the size, or at one size?
        "step_ms_by_tokens": {
            str(n): {"count": len(d)} | quantiles(d)
            for n, d in sorted(_by_tokens(steps).items())
            if len(d) >= 5
        },
        "engine_gc_count": len(timeline["engine_gc"]),
        "front_gc_count": len(timeline["front_gc"]),
    }


def _by_tokens(steps: list[tuple[float, float, int]]) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for _, seconds, tokens in steps:
        out.setdefault(tokens, []).append(seconds * 1e3)
    return out


def _heap_summary(stats: dict[str, Any]) -> dict[str, Any]:
    malloc = stats.get("malloc") or {}
    return {
        "rss_mb": round(stats["rss_bytes"] / 2**20, 1),
        "malloc_in_use_mb": round(malloc["in_use"] / 2**20, 1) if malloc else None,
        "malloc_free_in_arenas_mb": round(malloc["free_in_arenas"] / 2**20, 1) if malloc else None,
        "python_objects": stats.get("python_objects"),
        # What the worker itself read: its MALLOC_ARENA_MAX and its glibc thread-arena heaps.
        "malloc_arena_max": malloc.get("arena_max_env"),
        "thread_arena_heaps": malloc.get("thread_arena_heaps"),
    }


def _session_args(parser: argparse.ArgumentParser) -> None:
    """The session: models, modes, frames, budget, clock, engine."""
    parser.add_argument("--text-frames", type=int, default=3000)
    parser.add_argument("--video-frames", type=int, default=1000)
    parser.add_argument(
        "--models",
        default="text,video",
        help="comma-separated: text, video (tiny-qwen2-vl), smol (smol-qwen2-vl, the default "
        "model of make run)",
    )
    parser.add_argument(
        "--modes", default="rotate,idle,inline", help="rotate, idle, inline (comma-separated)"
    )
    parser.add_argument("--text-max-position", type=int, default=1024)
    parser.add_argument("--video-max-position", type=int, default=640)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--period-ms", type=float, default=300.0)
    parser.add_argument(
        "--gap-ms", type=float, default=None, help="idle time after each reply (overrides period)"
    )
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--piece", type=int, default=128, help="re-prefill piece, idle mode")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-mib", type=int, default=48)
    parser.add_argument("--rss-every", type=int, default=25)
    parser.add_argument("--list-slow", type=int, default=40)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--records", type=Path, default=None, help="per-frame records (JSON lines)")


def _ab_args(parser: argparse.ArgumentParser) -> None:
    """Diagnostics and the A/B switches (each value runs every session once)."""
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="time every model step and garbage collection; explain the slow frames by them "
        "(keeps ~150 bytes per step in the worker, up to 50,000 steps: ~0.6 MB per 1k 4-step "
        "frames of RSS slope, so measure the slope without it)",
    )
    parser.add_argument(
        "--malloc-arenas",
        default=None,
        help="run each session once per value of MALLOC_ARENA_MAX (comma-separated; 'glibc' is "
        "glibc's own default, 8 per core): an A/B of the engine's one-arena default in one "
        "invocation",
    )
    parser.add_argument(
        "--noise-probe-s",
        type=float,
        default=30.0,
        help="seconds of the machine-noise probe (a fixed CPU unit on the frame clock) before and "
        "after each session, engine stopped; 0 skips it",
    )
    parser.add_argument(
        "--omp-binds",
        default=None,
        help="run each session once per value of VLLM_CPU_OMP_THREADS_BIND (comma-separated, "
        "e.g. 'nobind,1': the worker's OpenMP threads left to the OS, or pinned to CPU 1)",
    )
    parser.add_argument(
        "--pin-front",
        default=None,
        help="CPUs (e.g. '0') for every thread of this process and of EngineCore once the "
        "engine runs: the worker then has the other CPUs to itself",
    )
    parser.add_argument(
        "--executors",
        default=None,
        help="run each session once per vLLM executor (comma-separated: 'mp', the CPU "
        "platform's worker process, or 'uni', the worker inside EngineCore)",
    )
    parser.add_argument(
        "--rss-after-trim",
        action="store_true",
        help="also read the worker's RSS right after a malloc_trim(0) at each RSS sample: memory "
        "held, without the free heap that the moment of the sample keeps",
    )
    parser.add_argument(
        "--shm-prefault",
        default=None,
        help="run each session once per value (comma-separated: 'on', vLLM's step rings "
        "resident from start-up with 1 MiB chunks, the server's default; 'off', vLLM's own "
        "16 MiB chunks, touched as messages reach them)",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="tracemalloc in the worker from the first tenth on (slows it: finds leaks, not tails)",
    )


def _run_variant(
    args: argparse.Namespace,
    model: str,
    mode: str,
    arena: str | None,
    bind: str | None,
    executor: str | None,
    prefault: str | None,
) -> dict[str, Any]:
    """One session under one set of A/B switches (set in the environment the engine inherits)."""
    if arena is not None:
        # Read by glibc when each engine process starts (they inherit it).
        value = str(8 * (os.cpu_count() or 1)) if arena == "glibc" else arena
        os.environ["MALLOC_ARENA_MAX"] = value
    if bind is not None:  # read by vLLM when it starts the worker
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    if prefault is not None:  # read by every engine process when it starts
        on = prefault.strip() == "on"
        os.environ[SHM_PREFAULT_ENV] = "1" if on else "0"
        os.environ[MQ_CHUNK_ENV] = str(PREFAULT_BYTES_PER_CHUNK >> 20) if on else "16"
    run = asyncio.run(run_session(args, model, mode, executor))
    return {
        "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX"),
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "pin_front": args.pin_front,
        "executor": executor or "mp",
        "shm_prefault": os.environ.get(SHM_PREFAULT_ENV, "1") != "0",
        "mq_chunk_mb": os.environ.get(MQ_CHUNK_ENV),
    } | run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    _session_args(parser)
    _ab_args(parser)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    names = {"text": TEXT_MODEL, "video": VIDEO_MODEL, "smol": SMOL_VIDEO_MODEL}
    runs = []
    arenas = args.malloc_arenas.split(",") if args.malloc_arenas else [None]
    binds = args.omp_binds.split(",") if args.omp_binds else [None]
    executors = args.executors.split(",") if args.executors else [None]
    prefaults = args.shm_prefault.split(",") if args.shm_prefault else [None]
    for key in args.models.split(","):
        for mode in args.modes.split(","):
            for arena, bind, executor, prefault in itertools.product(
                arenas, binds, executors, prefaults
            ):
                run = _run_variant(
                    args, names[key.strip()], mode.strip(), arena, bind, executor, prefault
                )
                runs.append(run)
                print(json.dumps({k: v for k, v in runs[-1].items() if k != "over_2x_p50"}))
    doc = {
        "bench": "tail_latency",
        "command": "python -m bench.tail_latency " + " ".join(argv or sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "runs": runs,
    }
    emit_json(doc, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
