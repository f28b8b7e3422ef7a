"""The machine's own tail: a fixed ~10 ms unit of single-threaded CPU work, run on a clock.

A frame of the video session is ~20 ms of work every 300 ms. On a shared virtual machine the
same fixed work, with nothing of ours running, has a tail of its own (slow bursts of seconds,
cold caches after each sleep), and no serving code can be flatter than that. `bench.tail_latency`
runs this probe before and after each session, in a process of its own with one thread, so a
session's p99/p50 can be read beside the machine's at that hour.

    python -m bench.machine_noise --seconds 60 --period-ms 300
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any


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
    command = [sys.executable, "-m", "bench.machine_noise", "--seconds", str(seconds)]
    out = subprocess.run(
        [*command, "--period-ms", str(period_s * 1e3)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--period-ms", type=float, default=300.0)
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.seconds, args.period_ms / 1e3)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
