"""Long endurance run of one bounded video session (mRoPE retention) on the tiny Qwen2-VL.

    python -m bench.video_endurance --frames 5000 --window 3

One session: a system chunk (the sink), then one 112×112 frame per chunk (distinct random
pixels, so no two frames share an encoder-cache entry), one sampled token per chunk. Every
`--every` frames it prints one JSON line: the median per-frame latency of the last interval,
the KV blocks and encoder-cache entries held, the mRoPE columns on the worker, and the RSS of
the EngineCore and worker processes. The last line is a summary with the RSS slopes (bytes per
frame, least squares over the samples after `--warmup` frames). The CI version is
tests/retention/test_video_retention.py (1,000 frames).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from realtime.models import DEFAULT_MODELS

MODEL = "tiny-qwen2-vl"
CHAT = DEFAULT_MODELS[MODEL].chat_format
SYSTEM = CHAT.system_turn("You are a helpful assistant.")


def frame_prompt(i: int) -> str:
    return CHAT.chunk(f"frame {i}", media="image", close_reply=True, reply=True)


def frame_image(seed: int) -> Any:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (112, 112, 3), dtype=np.uint8))


def slope(xs: list[float], ys: list[float]) -> float:
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0.0


async def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from vllm import SamplingParams
    from vllm.engine.protocol import StreamingInput
    from vllm.sampling_params import RequestOutputKind

    from realtime.engine import EngineSettings, start_engine
    from retention.vllm_adapter.introspect import kv_stats, retention_state, worker_stats

    engine = start_engine(
        EngineSettings(
            model=MODEL,
            max_model_len=1024,
            kv_cache_memory_bytes=48 << 20,
            block_size=32,
            max_num_seqs=16,
            dtype="float32",
            extra={"limit_mm_per_prompt": {"image": 1, "video": 1}},
        )
    )
    budget = {
        "sink_chunks": 1,
        "window_chunks": args.window,
        "low_watermark_ratio": 0.34,
        "max_position": args.max_position,
    }
    params = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
        extra_args={"streaming_retention": budget},
    )
    request_id = f"video-endurance-{uuid.uuid4().hex[:8]}"
    inputs: asyncio.Queue[Any] = asyncio.Queue()

    async def stream() -> AsyncIterator[Any]:
        while True:
            item = await inputs.get()
            if item is None:
                return
            yield item

    outputs: Any = None

    async def send(prompt: dict[str, Any]) -> None:
        nonlocal outputs
        inputs.put_nowait(StreamingInput(prompt=prompt))
        if outputs is None:
            outputs = engine.generate(stream(), params, request_id=request_id)
        while True:
            out = await outputs.__anext__()
            if out.finished:
                raise RuntimeError(f"session ended: {out.outputs[0].stop_reason}")
            if out.outputs[0].finish_reason is not None:
                return

    samples: list[dict[str, Any]] = []
    try:
        await send({"prompt": SYSTEM})
        interval: list[float] = []
        for i in range(1, args.frames + 1):
            prompt = {"prompt": frame_prompt(i), "multi_modal_data": {"image": frame_image(i)}}
            started = time.perf_counter()
            await send(prompt)
            interval.append((time.perf_counter() - started) * 1e3)
            if i % args.every == 0 or i == 10:
                kv = await kv_stats(engine)
                (worker,) = await worker_stats(engine)
                state = await retention_state(engine, request_id) or {}
                interval.sort()
                sample = {
                    "frame": i,
                    "median_ms": round(interval[len(interval) // 2], 2),
                    "blocks": kv["blocks_by_request"].get(request_id, 0),
                    "encoder_entries": kv["encoder_cache_entries"],
                    "worker_encoder_entries": worker["encoder_cache_entries"],
                    "mrope_columns": worker["mrope_columns_by_request"].get(request_id),
                    "tokens_held": state.get("tokens_held"),
                    "consolidations": state.get("consolidations"),
                    "core_rss": kv["rss_bytes"],
                    "worker_rss": worker["rss_bytes"],
                }
                interval = []
                samples.append(sample)
                print(json.dumps(sample), flush=True)
    finally:
        inputs.put_nowait(None)
        await engine.abort(request_id)
        await asyncio.sleep(0.5)
        free = await kv_stats(engine)
        engine.shutdown()
    warm = [s for s in samples if s["frame"] >= args.warmup]
    frames = [float(s["frame"]) for s in warm]
    summary = {
        "frames": args.frames,
        "window": args.window,
        "core_rss_slope_bytes_per_frame": round(
            slope(frames, [float(s["core_rss"]) for s in warm]), 1
        ),
        "worker_rss_slope_bytes_per_frame": round(
            slope(frames, [float(s["worker_rss"]) for s in warm]), 1
        ),
        "max_blocks": max(s["blocks"] for s in samples),
        "all_blocks_free_at_close": free["num_free_blocks"] == free["num_usable_blocks"],
    }
    print(json.dumps({"summary": summary}), flush=True)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=5000)
    parser.add_argument("--window", type=int, default=3, help="window_chunks of the budget")
    parser.add_argument("--max-position", type=int, default=2000)
    parser.add_argument("--every", type=int, default=100, help="sample every N frames")
    parser.add_argument("--warmup", type=int, default=500, help="frames before the RSS fit")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
