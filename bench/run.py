"""Side-by-side benchmark: bounded sessions vs unbounded sessions vs a stateless sliding window.

    .venv/bin/python -m pip install -e ".[bench]"     # matplotlib, for the plots
    .venv/bin/python -m bench.run --frames 1000 --out docs/bench --update-doc docs/benchmarks.md

One engine per model, the same frames for every mode (bench/driver.py):

(a) bounded: one streaming-input session with the server's default retention (sink 1 chunk,
    window 8 chunks), text turns on SmolLM2 (in-place eviction is implemented for 1D RoPE);
(b) unbounded: the same session without retention, until the context is full: our scheduler
    ends it with `context_length_exceeded` (stock vLLM 0.32 kills the engine there, see
    tests/retention/test_streaming_hardening.py, f);
(c) stateless: every frame a new request with the instructions and the last W frames (with the
    replies they got), W=16;
plus the video model (tiny-qwen2-vl, mRoPE) unbounded until its context is full, and bounded
(mRoPE retention, retention/vllm_adapter/mrope.py; a refusal would be recorded);
and 1/4/16 concurrent sessions of each text mode.

Measured per frame: latency (chunk handed to vLLM → last token), TTFT, KV blocks the session
holds (EngineCore's block tables, retention.vllm_adapter.introspect.kv_stats), the retention
counters; every few frames the RSS of the engine's processes (psutil). Retention's own cost is
timed inside EngineCore (bench/engine_timing.py). Results: results.json, PNG plots and
summary.md under --out, and the generated section of --update-doc.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from bench.driver import INSTRUCTIONS, image_frame, text_frame


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n")[0])
    p.add_argument("--frames", type=int, default=1000, help="frames of the bounded session (a)")
    p.add_argument("--unbounded-frames", type=int, default=None,
                   help="cap on (b); default: --frames (it ends at the context limit first)")  # fmt: skip
    p.add_argument("--stateless-frames", type=int, default=200, help="frames of (c)")
    p.add_argument("--window", type=int, default=16, help="W of the stateless sliding window")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens per reply")
    p.add_argument("--concurrency", default="1,4,16", help="session counts; '' to skip")
    p.add_argument("--concurrency-frames", type=int, default=16, help="frames per session")
    p.add_argument("--concurrency-modes", default="bounded,unbounded,stateless")
    p.add_argument("--concurrency-repeat", type=int, default=2,
                   help="rounds; each runs every mode at a level back to back, order rotated")  # fmt: skip
    p.add_argument("--video-frames", type=int, default=200, help="cap on the video runs; 0: skip")
    p.add_argument("--text-model", default="smollm2-135m-instruct")
    p.add_argument("--video-model", default="tiny-qwen2-vl")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    p.add_argument("--rss-every", type=int, default=10, help="sample RSS every N frames")
    p.add_argument("--out", type=Path, default=Path("docs/bench"))
    p.add_argument("--update-doc", type=Path, default=None,
                   help="markdown file whose generated section gets the summary")  # fmt: skip
    p.add_argument("--retention-max-position", type=int, default=None,
                   help="RoPE position limit of (a)'s budget (consolidates sooner); default: "
                   "the model's trained range, as the server")  # fmt: skip
    p.add_argument("--only-bounded", action="store_true",
                   help="run (a) only (e.g. with --retention-max-position, to time consolidations)")  # fmt: skip
    p.add_argument("--compare-old-path", action="store_true",
                   help="also run (a) on an engine with the pre-#38 scheduler composition (no "
                   "chunk-grammar part), first, and report both in `old_path_comparison`")  # fmt: skip
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--render", type=Path, default=None,
                   help="only re-render --out and --update-doc from this results.json")  # fmt: skip
    return p.parse_args(argv)


# --------------------------------------------------------------------------- engines


def text_engine_settings(args: argparse.Namespace, scheduler_cls: str | None = None) -> Any:
    """The text engine; `scheduler_cls` None: the production scheduler, timed."""
    from bench.engine_timing import SCHEDULER_CLS
    from realtime.engine import EngineSettings

    return EngineSettings(
        model=args.text_model,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        block_size=args.block_size,
        max_num_seqs=32,
        extra={"scheduler_cls": scheduler_cls or SCHEDULER_CLS},
    )


def video_engine_settings(args: argparse.Namespace) -> Any:
    from bench.engine_timing import SCHEDULER_CLS
    from realtime.engine import EngineSettings

    return EngineSettings(
        model=args.video_model,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        block_size=args.block_size,
        max_num_seqs=32,
        extra={
            "scheduler_cls": SCHEDULER_CLS,
            "limit_mm_per_prompt": {"image": 1, "video": 1},
        },
    )


async def start(settings: Any) -> tuple[Any, dict[str, Any]]:
    from realtime.engine import start_engine
    from retention.vllm_adapter.introspect import kv_stats

    t0 = time.perf_counter()
    engine = start_engine(settings)
    stats = await kv_stats(engine)
    info = {
        "model": settings.model,
        "dtype": str(engine.model_config.dtype).replace("torch.", ""),
        "max_model_len": int(engine.model_config.max_model_len),
        "block_size": stats["block_size"],
        "usable_blocks": stats["num_usable_blocks"],
        "kv_cache_memory_bytes": settings.kv_cache_memory_bytes,
        "uses_mrope": bool(engine.model_config.uses_mrope),
        "start_s": time.perf_counter() - t0,
    }
    return engine, info


# --------------------------------------------------------------------------- one session


async def run_session(
    engine: Any,
    *,
    name: str,
    frames: Any,
    n: int,
    multimodal: bool,
    modality: str,
    retention: dict[str, Any] | None,
    max_tokens: int,
    rss_every: int,
    stream: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    from bench.driver import (
        FrameRecord,
        SessionEnded,
        StreamingSession,
        engine_rss,
    )
    from realtime.engine_session import chat_format_of, render_chunk
    from vllm_realtime_protocol import SessionConfig

    config = SessionConfig(instructions=INSTRUCTIONS, modality=modality)
    chat = chat_format_of(engine)
    rid = f"bench-{name}-{stream}-{os.urandom(3).hex()}"
    session = StreamingSession(engine, rid, max_tokens, retention)
    records: list[dict[str, Any]] = []
    rss: list[dict[str, Any]] = []
    ended: dict[str, Any] | None = None
    t0 = time.perf_counter()
    try:
        for i in range(n):
            frame = frames(i, stream)
            prompt = await asyncio.to_thread(
                render_chunk, frame, config, chat=chat, first=i == 0, multimodal=multimodal
            )
            try:
                res = await session.send(prompt)
            except SessionEnded as exc:
                ended = {"frame": i + 1, "code": exc.code, "message": exc.stop_reason[:300]}
                break
            report = res.report
            assert report is not None, "a chunk boundary carries the session's report"
            counters = report.retention
            records.append(
                FrameRecord(
                    index=i,
                    latency_ms=res.latency_ms,
                    ttft_ms=res.ttft_ms,
                    completion_tokens=res.completion_tokens,
                    context_tokens=report.tokens_in_context,
                    kv_blocks=report.kv_blocks_held,
                    evictions=counters.evictions if counters else 0,
                    consolidations=counters.consolidations if counters else 0,
                    t=time.perf_counter() - t0,
                ).as_dict()
            )
            if i % rss_every == 0 or i == n - 1:
                by_proc = engine_rss()
                rss.append({"frame": i, "total": sum(by_proc.values()), "by_process": by_proc})
            if progress and (i + 1) % 50 == 0:
                last = records[-1]
                print(
                    f"  {name}: frame {i + 1}/{n} latency {last['latency_ms']:.0f} ms "
                    f"blocks {last['kv_blocks']} context {last['context_tokens']}",
                    flush=True,
                )
    finally:
        await session.close()
    return {
        "request_id": rid,
        "records": records,
        "rss": rss,
        "ended": ended,
        "wall_s": time.perf_counter() - t0,
        "blocks_after_close": await _blocks_after_close(engine, rid),
    }


async def _blocks_after_close(engine: Any, rid: str) -> int:
    from bench.driver import session_blocks

    held = 0
    for _ in range(50):
        held = await session_blocks(engine, rid)
        if held == 0:
            break
        await asyncio.sleep(0.1)
    return held


async def run_stateless(
    engine: Any,
    *,
    frames: Any,
    n: int,
    window: int,
    max_tokens: int,
    rss_every: int,
    block_size: int,
    modality: str = "text",
    multimodal: bool = False,
    stream: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    from bench.driver import (
        FrameRecord,
        blocks_for,
        engine_rss,
        sampling_params,
        stateless_prompt,
        stateless_request,
    )
    from realtime.engine_session import chat_format_of
    from vllm_realtime_protocol import SessionConfig

    config = SessionConfig(instructions=INSTRUCTIONS, modality=modality)
    chat = chat_format_of(engine)
    params = sampling_params(max_tokens, None)
    past: deque[tuple[Any, str]] = deque(maxlen=window)
    records: list[dict[str, Any]] = []
    rss: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for i in range(n):
        frame = frames(i, stream)
        prompt = await asyncio.to_thread(
            stateless_prompt, config, list(past), frame, multimodal=multimodal, chat=chat
        )
        res, prompt_len = await stateless_request(
            engine, prompt, params, f"bench-stateless-{stream}-{i}-{os.urandom(3).hex()}"
        )
        past.append((frame, res.text))
        held = prompt_len + res.completion_tokens - 1
        records.append(
            FrameRecord(
                index=i,
                latency_ms=res.latency_ms,
                ttft_ms=res.ttft_ms,
                completion_tokens=res.completion_tokens,
                context_tokens=prompt_len,
                kv_blocks=blocks_for(held, block_size),
                cached_tokens=res.cached_tokens,
                t=time.perf_counter() - t0,
            ).as_dict()
        )
        if i % rss_every == 0 or i == n - 1:
            by_proc = engine_rss()
            rss.append({"frame": i, "total": sum(by_proc.values()), "by_process": by_proc})
        if progress and (i + 1) % 50 == 0:
            print(f"  stateless: frame {i + 1}/{n} {res.latency_ms:.0f} ms", flush=True)
    return {"records": records, "rss": rss, "ended": None, "wall_s": time.perf_counter() - t0}


# --------------------------------------------------------------------------- concurrency


async def run_concurrency(
    engine: Any,
    args: argparse.Namespace,
    mode: str,
    sessions: int,
    *,
    frames: Any = text_frame,
    modality: str = "text",
    multimodal: bool = False,
) -> dict[str, Any]:
    from bench.driver import DEFAULT_RETENTION, KvPoller
    from bench.report import percentile

    poller = KvPoller(engine)
    poller.start()
    t0 = time.perf_counter()
    if mode == "stateless":
        coros = [
            run_stateless(
                engine,
                frames=frames,
                n=args.concurrency_frames,
                window=args.window,
                max_tokens=args.max_tokens,
                rss_every=10**9,
                block_size=args.block_size,
                modality=modality,
                multimodal=multimodal,
                stream=s + 1,
                progress=False,
            )
            for s in range(sessions)
        ]
    else:
        coros = [
            run_session(
                engine,
                name=f"c{sessions}-{mode}",
                frames=frames,
                n=args.concurrency_frames,
                multimodal=multimodal,
                modality=modality,
                retention=DEFAULT_RETENTION if mode == "bounded" else None,
                max_tokens=args.max_tokens,
                rss_every=10**9,
                stream=s + 1,
                progress=False,
            )
            for s in range(sessions)
        ]
    runs = await asyncio.gather(*coros)
    wall = time.perf_counter() - t0
    await poller.stop()
    latencies = [r["latency_ms"] for run in runs for r in run["records"]]
    blocks = [b for _, b, _ in poller.samples]
    return {
        "mode": mode,
        "sessions": sessions,
        "frames": len(latencies),
        "wall_s": wall,
        "frames_per_s": len(latencies) / wall if wall else 0.0,
        "latency_p50_ms": percentile(latencies, 50),
        "latency_p95_ms": percentile(latencies, 95),
        "kv_blocks_peak": max(blocks) if blocks else None,
        "kv_blocks_mean": sum(blocks) / len(blocks) if blocks else 0.0,
        "ended": sum(1 for run in runs if run["ended"]),
    }


# --------------------------------------------------------------------------- overhead


def retention_overhead(run: dict[str, Any], timing: dict[str, Any] | None) -> dict[str, Any]:
    from bench.report import median

    recs = run["records"]
    n = len(recs)
    out: dict[str, Any] = {"frames": n}
    t = (timing or {}).get(run["request_id"])
    if t:
        out.update(
            after_fold_calls=t["after_fold_calls"],
            after_fold_ms_per_1000_frames=t["after_fold_ns"] / 1e6 / n * 1000 if n else 0.0,
            after_fold_mean_us=t["after_fold_ns"] / 1e3 / max(1, t["after_fold_calls"]),
            after_fold_max_us=t["after_fold_max_ns"] / 1e3,
            evicting_folds=t["evicting_folds"],
            evicting_mean_us=(
                t["evicting_ns"] / 1e3 / t["evicting_folds"] if t["evicting_folds"] else None
            ),
            consolidating_folds=t["consolidating_folds"],
            consolidating_mean_us=(
                t["consolidating_ns"] / 1e3 / t["consolidating_folds"]
                if t["consolidating_folds"]
                else None
            ),
            fold_ms_per_1000_frames=t["fold_ns"] / 1e6 / n * 1000 if n else 0.0,
        )
        prefill = t.get("prefill_steps") or []
        reprefill = t.get("reprefill_steps") or []
        if reprefill:
            base_ms = median([s[0] / 1e6 for s in prefill])
            out.update(
                prefill_step_median_ms=base_ms,
                prefill_step_median_tokens=median([s[1] for s in prefill]),
                reprefill_steps=[{"ms": s[0] / 1e6, "tokens": s[1]} for s in reprefill],
                reprefill_extra_ms_mean=(
                    sum(s[0] / 1e6 for s in reprefill) / len(reprefill) - base_ms
                    if base_ms is not None
                    else None
                ),
            )
    # Latency-based estimates: which frames evicted / consolidated (counters moved).
    evicting, plain, extra = [], [], []
    for i, r in enumerate(recs):
        prev = recs[i - 1] if i else {"evictions": 0, "consolidations": 0}
        if r["consolidations"] > prev["consolidations"]:
            lo, hi = max(0, i - 25), min(n, i + 26)
            neighbours = [
                recs[j]["latency_ms"]
                for j in range(lo, hi)
                if j != i
                and recs[j]["consolidations"] == (recs[j - 1]["consolidations"] if j else 0)
            ]
            base = median(neighbours)
            if base is not None:
                extra.append(r["latency_ms"] - base)
        elif r["evictions"] > prev["evictions"]:
            evicting.append(r["latency_ms"])
        else:
            plain.append(r["latency_ms"])
    out.update(
        consolidations=recs[-1]["consolidations"] if recs else 0,
        evictions=recs[-1]["evictions"] if recs else 0,
        latency_median_evicting_ms=median(evicting),
        latency_median_plain_ms=median(plain),
        consolidation_extra_ms_mean=sum(extra) / len(extra) if extra else None,
        consolidation_extra_ms_per_1000_frames=sum(extra) / n * 1000 if n and extra else None,
    )
    out.setdefault("after_fold_ms_per_1000_frames", None)
    return out


# --------------------------------------------------------------------------- main


def _environment() -> dict[str, Any]:
    import torch
    import vllm

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "load_before": list(os.getloadavg()),
    }


def new_results(args: argparse.Namespace, command: str) -> dict[str, Any]:
    from bench.driver import DEFAULT_RETENTION

    return {
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": " ".join([command, *[shlex.quote(a) for a in sys.argv[1:]]]),
        "environment": _environment(),
        "params": {
            "max_tokens": args.max_tokens,
            "retention": DEFAULT_RETENTION,
            "window": args.window,
            "concurrency_frames": args.concurrency_frames,
        },
        "runs": {},
        "concurrency": [],
        "notes": [],
    }


async def bounded_run(
    engine: Any, args: argparse.Namespace, results: dict[str, Any], *, frames: Any,
    modality: str, multimodal: bool,
) -> dict[str, Any]:  # fmt: skip
    """(a): one bounded session of `--frames` frames, with the server's default retention."""
    from bench.driver import DEFAULT_RETENTION

    retention = dict(DEFAULT_RETENTION)
    if args.retention_max_position is not None:
        retention["max_position"] = args.retention_max_position
    results["params"]["retention"] = retention
    return await run_session(
        engine,
        name="bounded",
        frames=frames,
        n=args.frames,
        multimodal=multimodal,
        modality=modality,
        retention=retention,
        max_tokens=args.max_tokens,
        rss_every=args.rss_every,
    )


async def old_path_run(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    """(a) on an engine whose scheduler is the pre-#38 composition (`--compare-old-path`)."""
    from bench.engine_timing import OLD_PATH_SCHEDULER_CLS, bench_timing
    from bench.report import summarize_series

    print(f"old path: starting {args.text_model} with {OLD_PATH_SCHEDULER_CLS} ...", flush=True)
    engine, info = await start(text_engine_settings(args, OLD_PATH_SCHEDULER_CLS))
    load_before = os.getloadavg()
    try:
        print(f"old path: (a) bounded, {args.frames} frames", flush=True)
        run = await bounded_run(
            engine, args, results, frames=text_frame, modality="text", multimodal=False
        )
        timing = await bench_timing(engine)
    finally:
        engine.shutdown()
    return {
        "scheduler_cls": OLD_PATH_SCHEDULER_CLS,
        "trace": session_trace(run["records"]),
        "engine": info,
        "load_before": list(load_before),
        "load_after": list(os.getloadavg()),
        "summary": summarize_series(run["records"]),
        "retention_overhead": retention_overhead(run, timing),
    }


def session_trace(records: list[dict[str, Any]]) -> list[list[int]]:
    """What a run did, frame by frame, apart from its timing: greedy replies with EOS ignored
    make it the same on both paths unless the scheduler behaves differently."""
    keys = ("completion_tokens", "context_tokens", "kv_blocks", "evictions", "consolidations")
    return [[int(r[k] or 0) for k in keys] for r in records]


def old_path_comparison(results: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """(a)'s headline figures on both paths, side by side (production first)."""
    from bench.engine_timing import SCHEDULER_CLS
    from bench.report import summarize_series

    new_summary = summarize_series(results["runs"]["bounded"]["records"])
    paths = {
        "production": (SCHEDULER_CLS, new_summary, results["retention_overhead"]),
        "old_path": (old["scheduler_cls"], old["summary"], old["retention_overhead"]),
    }
    keys = ("latency_p50_ms", "latency_p95_ms", "ttft_p50_ms", "kv_blocks_max")
    overhead = ("fold_ms_per_1000_frames", "after_fold_mean_us", "after_fold_max_us")
    return {
        name: {
            "scheduler_cls": cls,
            **{k: summary.get(k) for k in keys},
            **{k: ov.get(k) for k in overhead},
        }
        for name, (cls, summary, ov) in paths.items()
    } | {
        "old_path_load": [old["load_before"], old["load_after"]],
        "same_trace": session_trace(results["runs"]["bounded"]["records"]) == old["trace"],
    }


async def compare_modes(
    engine: Any,
    args: argparse.Namespace,
    results: dict[str, Any],
    *,
    frames: Any,
    modality: str,
    multimodal: bool,
) -> None:
    """(a), (b), (c) and the concurrency levels on one engine, with the same frames."""
    from bench.engine_timing import bench_timing

    runs = results["runs"]
    print(f"(a) bounded, {args.frames} frames", flush=True)
    runs["bounded"] = await bounded_run(
        engine, args, results, frames=frames, modality=modality, multimodal=multimodal
    )
    ended = runs["bounded"]["ended"]
    if ended and ended["frame"] == 1:
        runs["bounded"]["note"] = "retention refused"
        results["notes"].append(f"(a) the scheduler refused retention: {ended['message']}")
    timing = await bench_timing(engine)
    results["retention_overhead"] = retention_overhead(runs["bounded"], timing)
    if args.only_bounded:
        return

    n_unbounded = args.unbounded_frames or args.frames
    print(f"(b) unbounded, up to {n_unbounded} frames", flush=True)
    runs["unbounded"] = await run_session(
        engine,
        name="unbounded",
        frames=frames,
        n=n_unbounded,
        multimodal=multimodal,
        modality=modality,
        retention=None,
        max_tokens=args.max_tokens,
        rss_every=args.rss_every,
    )
    runs["unbounded"]["engine_alive_after"] = await _engine_alive(engine)

    print(f"(c) stateless W={args.window}, {args.stateless_frames} frames", flush=True)
    runs["stateless"] = await run_stateless(
        engine,
        frames=frames,
        n=args.stateless_frames,
        window=args.window,
        max_tokens=args.max_tokens,
        rss_every=args.rss_every,
        block_size=results["text_engine"]["block_size"],
        modality=modality,
        multimodal=multimodal,
    )
    await run_concurrency_levels(
        engine, args, results, frames=frames, modality=modality, multimodal=multimodal
    )
    results["text_engine"]["free_blocks_at_end"] = await _free_blocks(engine)


async def run_concurrency_levels(
    engine: Any,
    args: argparse.Namespace,
    results: dict[str, Any],
    *,
    frames: Any,
    modality: str,
    multimodal: bool,
) -> None:
    """Every concurrency level, every mode, `--concurrency-repeat` rounds."""
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    modes = [m for m in args.concurrency_modes.split(",") if m]
    # The machine's load drifts: modes at one level run back to back, in a rotated order each
    # round, so that they compare under the same conditions.
    for rnd in range(max(1, args.concurrency_repeat)):
        for level in levels:
            order = modes[rnd % len(modes) :] + modes[: rnd % len(modes)]
            for mode in order:
                print(f"concurrency round {rnd + 1}: {level} x {mode}", flush=True)
                row = await run_concurrency(
                    engine, args, mode, level, frames=frames, modality=modality,
                    multimodal=multimodal,
                )  # fmt: skip
                row["round"] = rnd + 1
                row["load_1min"] = os.getloadavg()[0]
                results["concurrency"].append(row)


def finish_results(results: dict[str, Any], t_start: float) -> None:
    from bench.report import summarize_series

    for run in results["runs"].values():
        run["summary"] = summarize_series(run["records"])
    results["environment"]["load_after"] = list(os.getloadavg())
    results["wall_s"] = time.perf_counter() - t_start
    _notes(results)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    results = new_results(args, ".venv/bin/python -m bench.run")
    # The old path first, then the production path: one invocation, the same frames.
    old = await old_path_run(args, results) if args.compare_old_path else None
    print(f"starting {args.text_model} ...", flush=True)
    engine, info = await start(text_engine_settings(args))
    results["text_engine"] = info
    try:
        await compare_modes(
            engine, args, results, frames=text_frame, modality="text", multimodal=False
        )
    finally:
        engine.shutdown()
    if old is not None:
        results["old_path_comparison"] = old_path_comparison(results, old)

    if args.video_frames > 0:
        try:
            await _video_runs(args, results)
        except Exception as exc:  # keep the text results if the video engine fails
            results["notes"].append(f"The video runs failed: {type(exc).__name__}: {exc}"[:400])
    finish_results(results, t_start)
    return results


async def _video_runs(args: argparse.Namespace, results: dict[str, Any]) -> None:
    from bench.driver import DEFAULT_RETENTION

    runs = results["runs"]
    print(f"starting {args.video_model} ...", flush=True)
    vengine, vinfo = await start(video_engine_settings(args))
    results["video_engine"] = vinfo
    try:
        print(f"video unbounded, up to {args.video_frames} frames", flush=True)
        runs["video_unbounded"] = await run_session(
            vengine,
            name="video-unbounded",
            frames=image_frame,
            n=args.video_frames,
            multimodal=True,
            modality="video",
            retention=None,
            max_tokens=args.max_tokens,
            rss_every=args.rss_every,
        )
        print("video bounded (if this scheduler accepts retention for mRoPE)", flush=True)
        runs["video_bounded"] = await run_session(
            vengine,
            name="video-bounded",
            frames=image_frame,
            n=args.video_frames,
            multimodal=True,
            modality="video",
            retention=DEFAULT_RETENTION,
            max_tokens=args.max_tokens,
            rss_every=args.rss_every,
        )
        vb = runs["video_bounded"]
        if vb["ended"] and vb["ended"]["frame"] == 1:
            vb["note"] = "retention refused for this mRoPE model"
            results["notes"].append(
                f"Video retention: the scheduler refused the bounded video session: "
                f"{vb['ended']['message']}"
            )
    finally:
        vengine.shutdown()


_DERIVED_NOTES = ("(b) ended", "(c) prefix cache", "Admission:", "Video (", "Video bounded:")


def _notes(results: dict[str, Any]) -> None:
    notes = results["notes"]
    runs = results["runs"]
    text = results["text_engine"]
    ub = runs.get("unbounded")
    if ub and ub["ended"]:
        alive = ub.get("engine_alive_after")
        notes.append(
            f"(b) ended at frame {ub['ended']['frame']} with `{ub['ended']['code']}` "
            f"(context {ub['summary']['context_tokens_last']} tokens of "
            f"{text['max_model_len']}); the engine "
            f"{'kept serving' if alive else 'did NOT survive'} and the session's KV blocks were "
            f"freed ({ub['blocks_after_close']} left). Stock vLLM 0.32 would have sent the fold "
            "past max_model_len to the worker and killed the engine (EngineDeadError for every "
            "request)."
        )
    st = runs.get("stateless")
    if st and st["records"]:
        w = results["params"]["window"]

        def hit(recs: list[dict[str, Any]]) -> str:
            prompt = sum(r["context_tokens"] for r in recs)
            cached = sum(r["cached_tokens"] or 0 for r in recs)
            return f"{cached / prompt:.0%}" if prompt else "–"

        filling, sliding = st["records"][1 : w + 1], st["records"][w + 1 :]
        mean_prompt = sum(r["context_tokens"] for r in sliding) / len(sliding) if sliding else 0
        notes.append(
            f"(c) prefix cache (on, vLLM's default): {hit(filling)} of the prompt tokens were "
            f"cache hits while the window filled (frames 2-{min(w + 1, len(st['records']))}: "
            f"each prompt extends the "
            f"last one), {hit(sliding)} once it slides (the oldest frame drops out, so only the "
            f"instructions' full blocks repeat); a sliding request prefills ~{mean_prompt:.0f} "
            f"tokens. Its KV blocks are computed from the prompt length (held only while the "
            f"request runs)."
        )
    # No figure here: the server admits by footprint (realtime/admission.py), which depends on
    # the chunk caps a session declares; bench.capacity measures it through the real server.
    notes.append(
        "Admission: `vllm-realtime serve` reserves each session's worst-case KV footprint "
        "(sinks + window + remnants + the largest chunk + the reply, docs/architecture.md, "
        '"Admission by footprint"), not what these short frames hold, so it admits fewer '
        "sessions than the 16 run here (bench.capacity measures how many); this benchmark "
        "drives the engine directly to show what 16 sessions cost."
    )
    vu = runs.get("video_unbounded")
    if vu:
        notes.append(
            f"Video ({results['video_engine']['model']}, mRoPE): unbounded session "
            + (
                f"ended at frame {vu['ended']['frame']} with `{vu['ended']['code']}`."
                if vu["ended"]
                else f"ran {len(vu['records'])} frames."
            )
        )
    vb = runs.get("video_bounded")
    if vb and vb["records"] and not (vb["ended"] and vb["ended"]["frame"] == 1):
        last = vb["records"][-1]
        notes.append(
            f"Video bounded (mRoPE retention): "
            f"{len(vb['records'])} frames, {last['evictions']} evictions, "
            f"{last['consolidations']} consolidations, KV blocks max "
            f"{vb['summary']['kv_blocks_max']}"
            + (
                f"; ended at frame {vb['ended']['frame']}: `{vb['ended']['code']}`."
                if vb["ended"]
                else "."
            )
        )


async def _engine_alive(engine: Any) -> bool:
    try:
        await asyncio.wait_for(engine.check_health(), timeout=10)
        return True
    except Exception:
        return False


async def _free_blocks(engine: Any) -> int:
    from retention.vllm_adapter.introspect import kv_stats

    return int((await kv_stats(engine))["num_free_blocks"])


def write_outputs(results: dict[str, Any], out: Path, doc: Path | None, with_plots: bool) -> str:
    """results.json, the PNG plots and summary.md under `out`; the generated part of `doc`."""
    from bench.report import markdown, plots, update_doc

    results["plots"] = plots(results, out) if with_plots else []
    if with_plots and not results["plots"]:
        results["notes"].append('No plots: matplotlib is missing (`pip install -e ".[bench]"`).')
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    summary = markdown(results)
    (out / "summary.md").write_text(summary)
    if doc is not None:
        update_doc(doc, markdown(results, plots_rel=os.path.relpath(out, doc.parent)))
    return summary


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    # Unwinds asyncio.run, whose task cancellation runs the `finally` that shuts the engine
    # down; a plain SIGTERM would leave EngineCore and its worker running.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    args = parse_args(argv)
    if args.render is not None:
        results = json.loads(args.render.read_text())
        # Notes derived from the numbers are made again (by this version of _notes).
        results["notes"] = [
            n for n in results["notes"] if not n.startswith(("No plots", *_DERIVED_NOTES))
        ]
        _notes(results)
        args.out.mkdir(parents=True, exist_ok=True)
        print(write_outputs(results, args.out, args.update_doc, not args.no_plots))
        return 0
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.out.mkdir(parents=True, exist_ok=True)
    results = asyncio.run(main_async(args))
    print(write_outputs(results, args.out, args.update_doc, not args.no_plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
