"""Tiny random-weight Qwen3-VL and Qwen2.5-VL, built locally in seconds, like `tiny_vlm.py`.

They exist to prove the bounded-session machinery on the two mRoPE families people stream video
into, never to answer (random weights emit noise). Both share `tiny_vlm`'s tokenizer (byte-level
BPE + Qwen's special tokens, 1,024 ids) and its trimmed Qwen-VL chat template (Qwen3-VL's and
Qwen2.5-VL's templates place images and videos exactly as Qwen2-VL's does); each has its own
processor, so the engine writes what the family writes:

* Qwen3-VL: interleaved mRoPE (``mrope_interleaved``, section [4, 6, 6] of head_dim 32),
  deepstack (the vision tower's layers 0 and 1 feed the decoder's first two layers), patch 16,
  and videos as one ``<t seconds><|vision_start|>pads<|vision_end|>`` group per temporal patch
  (timestamps written as text by the processor). A 128×128 image is 16 LLM tokens.
* Qwen2.5-VL: windowed vision attention, patch 14, and a clip's temporal positions scaled by
  ``second_per_grid_ts × tokens_per_second`` (here 2 / fps × 4): a clip's positions can
  outgrow its token count. A 112×112 image is 16 LLM tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from realtime.models.tiny_vlm import (
    CHAT_TEMPLATE,
    VOCAB_SIZE,
    qwen_tokenizer_and_ids,
)

# Text model shared by both: hidden 128, 2 layers, 4/2 heads of 32 (the CPU attention minimum).
_TEXT: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


def _media_ids(ids: dict[str, int]) -> dict[str, int]:
    return {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }


def _save(model_cls: Any, config: Any, processor: Any, ids: dict[str, int], out: Path) -> None:
    import torch

    torch.manual_seed(0)  # reproducible weights: tests compare exact token ids across runs
    model = model_cls(config).to(torch.float32)
    model.save_pretrained(str(out))
    processor.save_pretrained(str(out))
    gen = {"eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]}
    (out / "generation_config.json").write_text(json.dumps(gen))


def build_tiny_qwen3_vl(out: Path) -> None:
    from transformers import (
        Qwen2VLImageProcessor,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    tok, ids = qwen_tokenizer_and_ids(out)
    text_config = {
        **_TEXT,
        "head_dim": 32,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [4, 6, 6],
            "mrope_interleaved": True,
        },
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
    }
    vision_config = {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
        "out_hidden_size": 128,
        "num_position_embeddings": 256,  # a 16×16 grid of learned positions (interpolated)
        "deepstack_visual_indexes": [0, 1],
    }
    config = Qwen3VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        tie_word_embeddings=False,
        **_media_ids(ids),
    )
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    size = {"shortest_edge": 64 * 64, "longest_edge": 256 * 256}  # min/max pixels
    # Qwen3-VL normalises images and video frames alike (mean = std = 0.5). Keep them equal:
    # vLLM 0.32 normalised this model's clips with the image processor's values when they
    # differed (its frames' encoder outputs equalled transformers' image features of them).
    norm = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    # Short clips as they come (the server decodes a few frames): no resampling by fps.
    processor = Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size, patch_size=16, merge_size=2, **norm),
        video_processor=Qwen3VLVideoProcessor(
            size=size, patch_size=16, merge_size=2, do_sample_frames=False, **norm
        ),
        tokenizer=tok,
        chat_template=CHAT_TEMPLATE,
    )
    _save(Qwen3VLForConditionalGeneration, config, processor, ids, out)


def build_tiny_qwen2_5_vl(out: Path) -> None:
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2_5_VLProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
    )

    tok, ids = qwen_tokenizer_and_ids(out)
    text_config = {
        **_TEXT,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [4, 6, 6],
        },
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
    }
    vision_config = {
        "depth": 2,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_heads": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
        "out_hidden_size": 128,
        "window_size": 56,  # 2×2 merged units per attention window
        "fullatt_block_indexes": [1],
        "tokens_per_second": 4,
    }
    config = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        tie_word_embeddings=False,
        **_media_ids(ids),
    )
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    size = {"shortest_edge": 56 * 56, "longest_edge": 224 * 224}  # min/max pixels
    processor = Qwen2_5_VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size, patch_size=14, merge_size=2),
        video_processor=Qwen2VLVideoProcessor(size=size, patch_size=14, merge_size=2),
        tokenizer=tok,
        chat_template=CHAT_TEMPLATE,
    )
    _save(Qwen2_5_VLForConditionalGeneration, config, processor, ids, out)
