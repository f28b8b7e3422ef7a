"""The server's front end runs with one torch thread on CPU (realtime.engine.
limit_front_end_threads): what vLLM's multimodal processor gives a frame is the same as with
torch's default threads, so the change is cost only (docs/benchmarks.md gives the cost).

The oracle is vLLM's own processor on the tiny Qwen2-VL (the default model's processor
configuration), no engine: pixel values equal, the same prompt with the same image tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from realtime import engine
from realtime.models import resolve_model

PROMPT = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What do you see?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture
def torch_threads() -> Iterator[Any]:
    import torch

    before = torch.get_num_threads()
    yield torch
    torch.set_num_threads(before)


def test_the_front_end_takes_one_torch_thread_on_cpu(
    torch_threads: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch_threads.set_num_threads(2)
    monkeypatch.setattr(engine, "_has_cuda", lambda: True)
    engine.limit_front_end_threads()
    assert torch_threads.get_num_threads() == 2  # a GPU's front end is left as it is
    monkeypatch.setattr(engine, "_has_cuda", lambda: False)
    engine.limit_front_end_threads()
    assert torch_threads.get_num_threads() == engine.FRONT_END_TORCH_THREADS == 1


@pytest.mark.parametrize("size", [(224, 224), (640, 480)])
def test_one_thread_processes_a_frame_as_the_default_does(
    torch_threads: Any, size: tuple[int, int]
) -> None:
    """224x224: the camera's frame (no resize); 640x480: resized by the processor."""
    import numpy as np
    from PIL import Image
    from vllm.config import ModelConfig
    from vllm.multimodal import MULTIMODAL_REGISTRY

    proc = MULTIMODAL_REGISTRY.create_processor(
        ModelConfig(model=resolve_model("tiny-qwen2-vl"), max_model_len=2048)
    )
    rgb = np.random.default_rng(1).integers(0, 255, (size[1], size[0], 3), np.uint8)
    image = Image.fromarray(rgb)

    def run(threads: int) -> tuple[list[int], dict[str, Any]]:
        torch_threads.set_num_threads(threads)
        out = proc(PROMPT, proc.info.parse_mm_data({"image": [image]}))
        (item,) = out["mm_kwargs"]["image"]
        return list(out["prompt_token_ids"]), item.get_data()

    tokens_default, data_default = run(2)
    tokens_one, data_one = run(1)
    assert tokens_one == tokens_default
    assert data_one.keys() == data_default.keys()
    for key in data_default:
        # Elementwise ops: the same values whatever the threads (not merely close).
        assert torch_threads.equal(data_one[key], data_default[key]), key
