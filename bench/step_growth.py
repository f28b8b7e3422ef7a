"""Worker memory per model step without retention: plain requests on the same engine settings.

    .venv/bin/python -m bench.step_growth --requests 1500            # anonymous RSS slope
    .venv/bin/python -m bench.step_growth --requests 300 --trace     # + allocation sites

The baseline for the worker RSS slope of `bench.tail_latency` (issue #21): one request at a time,
each a short prompt and `--max-tokens` steps (EOS ignored), on SmolLM2-135M with the bench's
engine settings (multiprocess engine, float32, 32-token blocks). Reports the slope of the
worker's anonymous RSS per 1k requests (least squares after the first tenth) and, with
`--trace`, the Python allocation sites that grew most (tracemalloc in the worker).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import uuid
from pathlib import Path
from typing import Any

from bench.report import emit_json, trace_summary
from bench.soak import _engine_settings, slope


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams

    from realtime.engine import start_engine
    from retention.vllm_adapter.diagnostics import DIAGNOSTICS_ENV, heap_stats
    from retention.vllm_adapter.introspect import worker_stats

    os.environ[DIAGNOSTICS_ENV] = "1"
    # The settings of bench.tail_latency's text runs.
    engine = start_engine(_engine_settings("smollm2-135m-instruct", max_num_seqs=4))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    samples: list[tuple[int, float]] = []
    trace: Any = None
    try:
        for i in range(args.requests):
            prompt = f"Frame {i}: the camera sees {i % 7} cats on a mat."
            async for _ in engine.generate(prompt, params, request_id=uuid.uuid4().hex):
                pass
            if i == args.requests // 10 and args.trace:
                await heap_stats(engine, "trace_start")
            if i % args.every == 0 or i == args.requests - 1:
                worker = (await worker_stats(engine))[0]
                samples.append((i, worker["rss_split_bytes"]["anon"] / 2**20))
        if args.trace:
            trace = trace_summary((await heap_stats(engine, "trace_top"))["workers"][0])
    finally:
        engine.shutdown()
    warm = [(i, mb) for i, mb in samples if i >= args.requests // 10]
    return {
        "bench": "step_growth",
        "requests": args.requests,
        "steps_per_request": args.max_tokens,
        "anon_slope_mb_per_1k_requests": round(
            slope([float(i) for i, _ in warm], [mb for _, mb in warm]) * 1000, 3
        ),
        "anon_samples_mb": [[i, round(mb, 1)] for i, mb in samples],
        "worker_trace_top": trace,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--every", type=int, default=50, help="sample the RSS every N requests")
    parser.add_argument("--trace", action="store_true", help="tracemalloc in the worker")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    doc = asyncio.run(run(args))
    doc["command"] = "python -m bench.step_growth " + " ".join(argv or sys.argv[1:])
    emit_json(doc, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
