"""The camera box: does admission by compute admit what this machine really answers in time?

    .venv/bin/python -m bench.camera_box --json docs/bench/camera-box.json          # ~20-40 min
    .venv/bin/python -m bench.camera_box --quick --json docs/bench/camera-box-quick.json  # <= 10

Starts `vllm-realtime serve` twice, as a user does (the default model and dtype; extra serve
flags after `--`), and drives it with the camera clients of `bench.capacity --camera` (the
page's session.open: window 4, max_tokens 8; one 224×224 JPEG offered a second, a tick skipped
while the previous reply is in flight):

1. **True capacity**, admission by compute off (`--compute-headroom 0`): 1, 2, 3, ... cameras,
   a fresh set each level, until a level misses the SLO: p99 per frame within the period
   (1 / fps) and at least 95% of the offered frames answered. The true capacity is the largest
   level that met it.
2. **Admitted**, admission on (serve's default headroom, or `--headroom`): twice the true
   capacity of cameras (at least 2) open at once; reported: how many were admitted, their p99
   and answered share, and admitted / true capacity (target 0.8-1.0, inside the SLO).

With each result: the CPU (`lscpu` model and its bf16/AVX-512 flags), the server's dtype line
and its start-up calibration, and the load average (a shared machine's figures say so).
`--quick`: 20 s a level, at most 6 levels.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.capacity import _camera_level

SLO_ANSWERED = 0.95


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
        while not _health(self.port):
            if self.proc.poll() is not None or time.perf_counter() - t0 > 900:
                self.__exit__()
                raise RuntimeError(f"the server did not start; its log: {self.log}")
            time.sleep(0.5)
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
        seconds=args.seconds,
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


async def _levels(url: str, args: argparse.Namespace) -> tuple[int, list[dict[str, Any]]]:
    period_ms = 1e3 / args.fps
    capacity, levels = 0, []
    for n in range(1, args.max_level + 1):
        level = await _camera_level(url, n, _client_args(args))
        level["meets_slo"] = meets_slo(level, period_ms)
        print(json.dumps(level), flush=True)
        levels.append(level)
        await asyncio.sleep(2)  # the closed sessions' blocks go back to the pool
        if not level["meets_slo"]:
            break
        capacity = n
    return capacity, levels


def run(args: argparse.Namespace) -> dict[str, Any]:
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
    result["admitted_over_true"] = round(level["admitted"] / capacity, 2) if capacity else None
    ratio = result["admitted_over_true"]
    result["target_met"] = bool(ratio is not None and 0.8 <= ratio <= 1.0 and level["meets_slo"])
    result["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 s a level, at most 6 levels")
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds per level")
    parser.add_argument("--max-level", type=int, default=40, help="most cameras tried")
    parser.add_argument("--fps", type=float, default=1.0)
    parser.add_argument("--window", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--declare", action="store_true", help="open with the page's limits")
    parser.add_argument("--headroom", type=float, default=None, help="default: serve's")
    parser.add_argument("--port", type=int, default=8031)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("serve_args", nargs="*", help="after --: more flags for serve")
    args = parser.parse_args()
    if args.quick:
        args.seconds = min(args.seconds, 20.0)
        args.max_level = min(args.max_level, 6)
    result = run(args)
    out = json.dumps(result, indent=2)
    print(out)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(out + "\n")


if __name__ == "__main__":
    main()
