"""Memory diagnostics for bench/soak.py and bench/tail_latency.py, never in a production engine.

Installed only in an engine started with introspection (`EngineSettings(introspection=True)`,
carried in the engine's config: settings.py); the plugin then adds `heap_stats` to EngineCore and
the workers (`introspect.install_introspection`). Installing adds one method and costs nothing
per step; its actions are what is slow (tracemalloc, gc walks, the `execute_model` wrappers of
"steps_start" and "timeline_start"), and they run only when a benchmark asks.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from retention.vllm_adapter.heap_trim import libc_function, trim_now
from retention.vllm_adapter.rss import _rss_bytes, _rss_split

HEAP_STATS_METHOD = "vllm_realtime_heap_stats"
# Per-process diagnostic state: "mallinfo2" (bound once: a ctypes type per call would leak),
# "trace_baseline" (the snapshot "trace_top" compares against), "step_sizes" (once counting).
_DIAGNOSTICS: dict[str, Any] = {}


def malloc_info() -> dict[str, Any] | None:
    """glibc's own accounting (mallinfo2): bytes in use vs held free, to tell a leak (in use
    grows) from allocator retention (RSS grows, in use flat). None off glibc."""
    import ctypes

    if "mallinfo2" not in _DIAGNOSTICS:

        class MallInfo2(ctypes.Structure):
            _fields_ = [
                (name, ctypes.c_size_t)
                for name in (
                    "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                    "fsmblks", "uordblks", "fordblks", "keepcost",
                )
            ]  # fmt: skip

        bound = libc_function("mallinfo2")
        if bound is not None:
            bound.restype = MallInfo2
        _DIAGNOSTICS["mallinfo2"] = bound
    fn = _DIAGNOSTICS["mallinfo2"]
    if fn is None:
        return None
    info = fn()
    return {
        "in_use": int(info.uordblks + info.hblkhd),  # live small chunks + live mmapped chunks
        "free_in_arenas": int(info.fordblks),
        "arena": int(info.arena),
        "mmapped": int(info.hblkhd),
        # Whether MALLOC_ARENA_MAX took effect. The process's own view: /proc/<pid>/environ of
        # an engine process is overwritten by its title ("VLLM::Worker") and cannot tell.
        "arena_max_env": os.environ.get("MALLOC_ARENA_MAX"),
        "thread_arena_heaps": thread_arena_heaps(),
    }


HEAP_MAX_SIZE = 64 << 20
"""glibc's reservation per thread-arena heap on 64-bit (the main arena is `[heap]`)."""


def thread_arena_heaps(maps: str | None = None) -> int | None:
    """glibc thread-arena heaps of this process (`maps`: a /proc/<pid>/maps text): anonymous
    mappings that begin on a HEAP_MAX_SIZE boundary and, with what follows them in the same
    aligned region, span exactly HEAP_MAX_SIZE (a used part, then a reserved one). 0 with
    MALLOC_ARENA_MAX=1. None where /proc cannot be read."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return None
    regions: dict[int, list[tuple[int, int]]] = {}
    for line in maps.splitlines():
        fields = line.split()
        if len(fields) != 5:  # named mappings ([heap], files, [stack]) have a sixth field
            continue
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        base = lo & ~(HEAP_MAX_SIZE - 1)
        if hi <= base + HEAP_MAX_SIZE:
            regions.setdefault(base, []).append((lo, hi))
    return sum(
        1
        for base, spans in regions.items()
        if spans[0][0] == base and sum(hi - lo for lo, hi in spans) == HEAP_MAX_SIZE
    )


def _count_step_sizes(runner: Any) -> None:
    """Record every step's token count (vLLM's CPU matmuls keep state per distinct count)."""
    sizes: set[int] = set()
    _DIAGNOSTICS["step_sizes"] = sizes
    original = runner.execute_model

    def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        sizes.add(int(getattr(scheduler_output, "total_num_scheduled_tokens", 0)))
        return original(scheduler_output, *args, **kwargs)

    runner.execute_model = execute_model


def _start_timeline(runner: Any) -> None:
    """Record each model step (wall start, seconds, tokens) and each garbage collection over
    2 ms (wall start, seconds, generation) of this process, to explain slow frames."""
    import time
    from collections import deque

    if "timeline" in _DIAGNOSTICS:
        return
    steps: deque[tuple[float, float, int]] = deque(maxlen=50_000)
    collections: deque[tuple[float, float, int]] = deque(maxlen=10_000)
    _DIAGNOSTICS["timeline"] = {"steps": steps, "gc": collections}
    if runner is not None:
        original = runner.execute_model

        def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.time()
            try:
                return original(scheduler_output, *args, **kwargs)
            finally:
                tokens = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0))
                steps.append((start, time.time() - start, tokens))

        runner.execute_model = execute_model
    watch_gc(collections)


def watch_gc(into: Any) -> None:
    """Append each garbage collection over 2 ms of this process to `into`: (wall start,
    seconds, generation)."""
    import gc
    import time

    started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.time()
        elif (took := time.time() - started[0]) > 0.002:
            into.append((started[0], took, int(info.get("generation", -1))))

    gc.callbacks.append(on_gc)


def _heap_stats(_owner: Any, action: str = "read", top: int = 15) -> dict[str, Any]:
    """Memory diagnostics of this process (EngineCore or a worker), for bench/soak.py.

    "read": RSS, malloc accounting, live Python objects. "types": also the most common object
    types. "timeline_start" / "timeline_read": model steps and garbage collections with their
    wall-clock times (`_start_timeline`). "steps_start" (worker): from now on, count the distinct step sizes. "trace_start":
    start tracemalloc and keep a baseline (slows allocation: diagnostic runs only).
    "trace_top": the allocation sites grown most since the baseline. "trim_read": return the
    free heap to the OS first (`malloc_trim(0)`), then read RSS by kind and malloc's accounting
    only (no object walk): memory the process holds, without the free heap the moment keeps.
    """
    import gc
    import tracemalloc
    from collections import Counter

    if action == "trim_read":
        trim_now()
        return {
            "pid": os.getpid(),
            "rss_bytes": _rss_bytes(),
            "rss_split_bytes": _rss_split(),
            "malloc": malloc_info(),
        }
    out: dict[str, Any] = {"pid": os.getpid(), "rss_bytes": _rss_bytes(), "malloc": malloc_info()}
    runner = getattr(_owner, "model_runner", None)
    if action == "steps_start" and runner is not None and "step_sizes" not in _DIAGNOSTICS:
        _count_step_sizes(runner)
    if action == "timeline_start":
        _start_timeline(runner)
    elif action == "timeline_read" and "timeline" in _DIAGNOSTICS:
        out["timeline"] = {k: list(v) for k, v in _DIAGNOSTICS["timeline"].items()}
    if "step_sizes" in _DIAGNOSTICS:
        out["distinct_step_sizes"] = len(_DIAGNOSTICS["step_sizes"])
    objects = gc.get_objects()
    out["python_objects"] = len(objects)
    if action == "types":
        counts = Counter(type(o).__qualname__ for o in objects)
        out["types"] = dict(counts.most_common(top))
    del objects
    if action == "trace_start":
        tracemalloc.start(8)
        _DIAGNOSTICS["trace_baseline"] = tracemalloc.take_snapshot()
    elif action == "trace_top" and "trace_baseline" in _DIAGNOSTICS and tracemalloc.is_tracing():
        snapshot = tracemalloc.take_snapshot()
        diffs = snapshot.compare_to(_DIAGNOSTICS["trace_baseline"], "traceback")
        out["traced_bytes"] = tracemalloc.get_traced_memory()[0]
        out["trace_top"] = [
            {
                "stack": [_short_frame(f) for f in d.traceback],  # outermost frame first
                "size_diff": d.size_diff,
                "count_diff": d.count_diff,
            }
            for d in diffs[:top]
        ]
    return out


def _short_frame(frame: Any) -> str:
    """``file:line`` with the file relative to its package root (no machine paths in reports)."""
    import re

    name = str(frame.filename)
    short = re.sub(r"^.*/(site-packages|lib/python3\.\d+)/", "", name)
    if short == name:
        short = name.removeprefix(str(Path(__file__).resolve().parents[2]) + "/")
    return f"{short}:{frame.lineno}"


def install_diagnostics() -> None:
    """Idempotently add `_heap_stats` to EngineCore and the workers (introspection only)."""
    from vllm.v1.engine.core import EngineCore

    from retention.vllm_adapter.import_hooks import patch_on_import

    if not hasattr(EngineCore, HEAP_STATS_METHOD):
        setattr(EngineCore, HEAP_STATS_METHOD, _heap_stats)
    patch_on_import("vllm.v1.worker.worker_base", _patch_worker)


def _patch_worker(module: Any) -> None:
    if not hasattr(module.WorkerBase, HEAP_STATS_METHOD):
        setattr(module.WorkerBase, HEAP_STATS_METHOD, _heap_stats)


async def heap_stats(engine: Any, action: str = "read") -> dict[str, Any]:
    """From the front end: `_heap_stats` of the EngineCore and of each worker (the engine must
    have been started with introspection)."""
    core = await engine.engine_core.call_utility_async(HEAP_STATS_METHOD, action)
    workers = await engine.collective_rpc(HEAP_STATS_METHOD, args=(action,))
    return {"engine_core": core, "workers": workers}
