"""A tiny random-weight SmolVLM (Idefics3 vision + a Llama LM: 1D RoPE with images), built in
seconds, so the 1D-position video paths run on a CPU.

Like `tiny_vlm.py` (whose tokenizer recipe it reuses) it exists to exercise the machinery, never
to answer. Sizes: text hidden 128, 2 layers, 4/2 heads (head_dim 32, the CPU attention minimum),
plain 1D RoPE; vision hidden 64, 2 layers, 2 heads, patch 8 on 32-pixel tiles, pixel-shuffle
scale 2, so one tile is 4 `<image>` tokens.

Image splitting stays ON, kept small, so SmolVLM's splitting tokens are exercised: the processor
resizes the longest edge to 64 pixels and cuts tiles of 32 (`size`, `max_image_size`), so a
frame is at most 2 × 2 tiles plus the global image. A square frame (the tests' 112 × 112) is
always exactly: 4 tiles `<fake_token_around_image><row_r_col_c><image>×4` with a newline after
each row, a newline, then `<fake_token_around_image><global-img><image>×4<fake_token_around_image>`
= 20 `<image>` tokens, 34 tokens in all. A frame that fits one tile is the global image alone.

The chat template follows SmolVLM's (`User:` / `Assistant:` turns closed by
`<end_of_utterance>`, `<image>` where an image goes), except that every turn opens with
`<|im_start|>` (SmolVLM writes it once, before the first turn): the server writes each chunk's
turns itself and needs every turn to open the same way (realtime/prompt_format.py). It writes
no video placeholder: vLLM 0.32 serves SmolVLM with images only, so a clip is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from realtime.models.tiny_vlm import VOCAB_SIZE, build_bpe_tokenizer

TILE = 32
"""Tile side (`max_image_size`) and the vision tower's image size."""
LONGEST_EDGE = 64
"""The processor resizes a frame's longest edge to this: at most 2 × 2 tiles."""
PATCH = 8
SCALE_FACTOR = 2
IMAGE_SEQ_LEN = (TILE // PATCH) ** 2 // SCALE_FACTOR**2  # <image> tokens per tile: 4


def special_tokens(grid: int) -> list[str]:
    """The tokenizer's special tokens, with the row/column markers of up to grid × grid tiles."""
    return [
        "<|endoftext|>",
        "<|im_start|>",
        "<end_of_utterance>",
        "<fake_token_around_image>",
        "<global-img>",
        "<image>",
        *(f"<row_{r}_col_{c}>" for r in range(1, grid + 1) for c in range(1, grid + 1)),
    ]


SPECIAL_TOKENS = special_tokens(max(LONGEST_EDGE // TILE, 1))

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] | capitalize }}:"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or 'image' in part %}<image>"
    "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>Assistant:{% endif %}"
)


def build_tiny_smolvlm(
    out: Path,
    *,
    tile: int = TILE,
    longest_edge: int = LONGEST_EDGE,
    patch: int = PATCH,
    scale_factor: int = SCALE_FACTOR,
) -> None:
    """Build the model; the keywords give other geometries (tests put a published processor
    config on one with SmolVLM-256M's: 512-px tiles, patch 16, scale factor 4, 64 tokens)."""
    import torch
    from transformers import AutoTokenizer, SmolVLMConfig, SmolVLMForConditionalGeneration

    out.mkdir(parents=True, exist_ok=True)
    specials = special_tokens(max(longest_edge // tile, 1))
    build_bpe_tokenizer(
        out,
        special_tokens=specials,
        chat_template=CHAT_TEMPLATE,
        eos_token="<end_of_utterance>",
        pad_token="<|endoftext|>",
    )
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = {t: tok.convert_tokens_to_ids(t) for t in specials}
    text_config = {
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "bos_token_id": ids["<|im_start|>"],
        "eos_token_id": ids["<end_of_utterance>"],
        "pad_token_id": ids["<|endoftext|>"],
    }
    vision_config = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": tile,
        "patch_size": patch,
    }
    config = SmolVLMConfig(
        text_config=text_config,
        vision_config=vision_config,
        scale_factor=scale_factor,
        image_token_id=ids["<image>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["SmolVLMForConditionalGeneration"]
    torch.manual_seed(0)  # reproducible weights: tests compare exact token ids across runs
    model = SmolVLMForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(str(out))
    _save_processor(
        out,
        tok,
        tile=tile,
        longest_edge=longest_edge,
        seq_len=(tile // patch) ** 2 // scale_factor**2,
    )
    gen = {"eos_token_id": ids["<end_of_utterance>"], "pad_token_id": ids["<|endoftext|>"]}
    (out / "generation_config.json").write_text(json.dumps(gen))


def _save_processor(out: Path, tok: Any, *, tile: int, longest_edge: int, seq_len: int) -> None:
    from transformers import SmolVLMImageProcessor, SmolVLMProcessor, SmolVLMVideoProcessor

    sizes = {
        "size": {"longest_edge": longest_edge},
        "max_image_size": {"longest_edge": tile},
        "do_image_splitting": True,
    }
    processor = SmolVLMProcessor(
        image_processor=SmolVLMImageProcessor(**sizes),
        video_processor=SmolVLMVideoProcessor(**sizes),
        tokenizer=tok,
        image_seq_len=seq_len,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(out))
