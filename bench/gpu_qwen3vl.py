"""The same comparison on a CUDA machine: vllm==0.32.0, Qwen3-VL-8B-Instruct, image frames.

Ready to run, not run here (the project's machines have no GPU). On a machine with one NVIDIA
GPU (24 GB or more for the 8B model in bf16; an H100/H200 for 16 concurrent sessions at the
default context) and the model reachable (hub id, or a local path via --model):

    bash scripts/setup.sh                                  # takes the CUDA branch: vllm==0.32.0
    .venv/bin/python -m pip install -e ".[bench]"
    .venv/bin/python -m bench.gpu_qwen3vl --out docs/bench-gpu --update-doc docs/benchmarks-gpu.md

Every mode gets the same synthetic 448x448 JPEG camera frames (bench/frames.py; ~196 visual
tokens each on Qwen3-VL), or the frames of a clip with --video:

(a) bounded: one streaming-input session with the server's default retention. Qwen3-VL uses
    mRoPE (retention/vllm_adapter/mrope.py); if the scheduler refuses the session
    (`retention_unsupported`, e.g. on vLLM's V2 model runner) the refusal is recorded;
(b) unbounded: the same session without retention, until max_model_len
    (`context_length_exceeded` from our scheduler; the engine survives);
(c) stateless: every frame a new request with the instructions and the last W frames (W=16
    images per request, so --limit-mm-per-prompt allows W+1 images);
plus 1/4/16 concurrent sessions of each. Output: results.json, PNG plots, summary.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

from bench.frames import image_frame
from bench.run import compare_modes, finish_results, new_results, parse_args, start, write_outputs

DEFAULT_MODEL = "Qwen/Qwen3-VL-8B-Instruct"


def gpu_args(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.Namespace]:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--model", default=DEFAULT_MODEL)
    extra.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    extra.add_argument("--frame-size", type=int, default=448)
    extra.add_argument("--video", type=Path, default=None, help="take frames from this clip")
    extra.add_argument("--enforce-eager", action="store_true")
    mine, rest = extra.parse_known_args(argv)
    defaults = [
        "--frames", "1000",
        "--stateless-frames", "200",
        "--max-tokens", "16",
        "--max-model-len", "32768",
        "--concurrency-frames", "32",
        "--video-frames", "0",
        "--out", "docs/bench-gpu",
    ]  # fmt: skip
    args = parse_args([*defaults, *rest])  # later flags win
    return mine, args


@lru_cache(maxsize=1)
def _clip_frames(path: str, size: int) -> list[bytes]:
    import io

    import av

    out: list[bytes] = []
    with av.open(path) as container:
        for frame in container.decode(video=0):
            img = frame.to_image().convert("RGB").resize((size, size))
            buf = io.BytesIO()
            img.save(buf, format="JPEG", quality=85)
            out.append(buf.getvalue())
    if not out:
        raise SystemExit(f"no video frames in {path}")
    return out


def frame_source(mine: argparse.Namespace) -> Any:
    if mine.video is None:
        return lambda i, stream=0: image_frame(i, stream, mine.frame_size)

    from protocol.state import Frame

    def from_clip(i: int, stream: int = 0) -> Frame:
        frames = _clip_frames(str(mine.video), mine.frame_size)
        return Frame(
            frame_index=i,
            frame_id=f"s{stream}-f{i}",
            kind="image",
            media_format="jpeg",
            data=frames[(i + 97 * stream) % len(frames)],
            text=None,
            prompt=None,
            timestamp=float(i),
        )

    return from_clip


def engine_settings(mine: argparse.Namespace, args: argparse.Namespace) -> Any:
    from bench.engine_timing import SCHEDULER_CLS
    from realtime.engine import EngineSettings

    return EngineSettings(
        model=mine.model,
        max_model_len=args.max_model_len,
        kv_cache_memory_bytes=None,  # size the KV cache from --gpu-memory-utilization
        block_size=None,
        max_num_seqs=64,
        enforce_eager=mine.enforce_eager,
        extra={
            "scheduler_cls": SCHEDULER_CLS,
            "gpu_memory_utilization": mine.gpu_memory_utilization,
            "limit_mm_per_prompt": {"image": args.window + 1, "video": 0},
        },
    )


async def main_async(mine: argparse.Namespace, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench.gpu_qwen3vl needs a CUDA GPU (use bench.run on CPU)")
    t_start = time.perf_counter()
    results = new_results(args, ".venv/bin/python -m bench.gpu_qwen3vl")
    results["environment"]["gpu"] = torch.cuda.get_device_name(0)
    print(f"starting {mine.model} ...", flush=True)
    engine, info = await start(engine_settings(mine, args))
    results["text_engine"] = info
    try:
        await compare_modes(
            engine, args, results, frames=frame_source(mine), modality="video", multimodal=True
        )
    finally:
        engine.shutdown()
    finish_results(results, t_start)
    return results


def main(argv: list[str] | None = None) -> int:
    mine, args = gpu_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args.out.mkdir(parents=True, exist_ok=True)
    results = asyncio.run(main_async(mine, args))
    print(write_outputs(results, args.out, args.update_doc, not args.no_plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
