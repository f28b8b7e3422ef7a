"""A frame's cost in vLLM's front end: the multimodal processor the server's process runs for
every frame (the model's HF processor, then the cast of its pixels to the model's dtype),
by torch thread count and by the HF image processor's backend. No engine.

    .venv/bin/python -m bench.frontend_cost                      # the default served model
    .venv/bin/python -m bench.frontend_cost --model tiny-qwen2-vl --frames 60

Each configuration gets the same 224x224 frame (a camera's) in turn, in one process, so a
machine whose load changes during the run affects them alike. Reported per configuration:
wall-clock median and p90, and the median CPU time of this process (threads included). The
server runs the front end with one torch thread on CPU (realtime/engine.py,
FRONT_END_TORCH_THREADS) and the model's own (torchvision) image processor.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from realtime.models import DEFAULT_SERVE_MODEL, resolve_model

# The page's frame prompt in the default models' chat format (Qwen2-VL's placeholders).
PROMPT = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What do you see?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
BACKENDS: dict[str, dict[str, Any] | None] = {
    "torchvision": None,  # the model's processor as vLLM loads it by default
    "pil": {"use_fast": False},  # transformers' PIL backend, chosen through mm_processor_kwargs
}


def main() -> None:
    import numpy as np
    import torch
    from PIL import Image
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.processing import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_SERVE_MODEL)
    parser.add_argument("--frames", type=int, default=40, help="timed frames per configuration")
    parser.add_argument("--threads", default="2,1", help="torch thread counts to compare")
    args = parser.parse_args()
    path = resolve_model(args.model)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (224, 224, 3), np.uint8))
    processors = {
        name: MULTIMODAL_REGISTRY.create_processor(
            ModelConfig(model=path, max_model_len=2048, mm_processor_kwargs=kw)
        )
        for name, kw in BACKENDS.items()
    }
    prompt = processors["torchvision"].info.get_tokenizer().encode(PROMPT)
    threads = [int(t) for t in args.threads.split(",")]
    samples: dict[tuple[str, int], list[tuple[float, float]]] = {}
    warmup = 3
    for i in range(args.frames + warmup):
        for name, proc in processors.items():
            for n in threads:
                torch.set_num_threads(n)
                items = proc.info.parse_mm_data({"image": [image]})
                wall, cpu = time.perf_counter(), time.process_time()
                proc.apply(ProcessorInputs(list(prompt), items), TimingContext(enabled=False))
                if i >= warmup:
                    samples.setdefault((name, n), []).append(
                        ((time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3)
                    )
    for (name, n), s in samples.items():
        walls = sorted(w for w, _ in s)
        print(
            json.dumps(
                {
                    "image_processor": name,
                    "torch_threads": n,
                    "wall_p50_ms": round(statistics.median(walls), 2),
                    "wall_p90_ms": round(walls[int(0.9 * (len(walls) - 1))], 2),
                    "cpu_p50_ms": round(statistics.median(c for _, c in s), 2),
                    "frames": len(s),
                }
            )
        )


if __name__ == "__main__":
    main()
