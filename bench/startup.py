"""Start-up time of `vllm-realtime serve`: the command to `/health` 200, its log's warnings, and
the worker's memory.

    .venv/bin/python -m bench.startup --json docs/bench/startup.json -- --port 8011

Starts the server as a user does (`python -m realtime.cli serve ARGS`), polls `/health` every
0.2 s, then reads the log: the lines at WARNING or above, the KV pool line, the dtype line; and
the resident memory of the server's process tree (EngineCore and its worker included). Ends the
server with SIGINT. `--runs N` starts it N times in a row (A/B: run it on two checkouts back to
back, `--cwd` for the other one).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--cwd", type=Path, default=Path.cwd(), help="the checkout to start")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("serve_args", nargs="*", help="after --: the arguments of serve")
    args = parser.parse_args()
    runs = [one_start(args.serve_args, args.port, args.cwd, args.timeout) for _ in range(args.runs)]
    out = json.dumps(
        {"cwd_commit": _commit(args.cwd), "serve_args": args.serve_args, "runs": runs}, indent=2
    )
    print(out)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(out + "\n")


def _commit(cwd: Path) -> str:
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"], cwd=cwd, text=True
        ).strip()
    except Exception:
        return "unknown"


if __name__ == "__main__":
    main()
