"""A tiny random-weight Qwen2-VL, built locally in seconds, so every video path runs on a CPU.

Its captions are noise: it exists to exercise the machinery (mRoPE positions, the vision encoder,
the encoder cache, placeholders), never to answer. Sizes: text hidden 128, 2 layers, 4/2 heads
(head_dim 32, the CPU attention minimum), mrope_section [4, 6, 6]; vision depth 2, embed 64,
patch 14, merge 2, so a 112×112 image becomes 16 LLM tokens. The tokenizer is a byte-level BPE
trained here on a small corpus plus Qwen's special tokens, padded to a 1,024 vocab so that every
id decodes (random weights sample any id).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB_SIZE = 1024
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]


# Qwen2-VL's template, trimmed to what the service renders: system/user/assistant turns whose
# content is a string or a list of {"type": "text"|"image"|"video"} parts.
def vision_chat_template(default_system: str) -> str:
    """Qwen2-VL's chat template, trimmed to what the service renders, with this default
    system prompt (also smol_vlm's)."""
    return (
        "{% for message in messages %}"
        "{% if loop.first and message['role'] != 'system' %}"
        "<|im_start|>system\n" + default_system + "<|im_end|>\n{% endif %}"
        "<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' or 'image' in part %}"
        "<|vision_start|><|image_pad|><|vision_end|>"
        "{% elif part['type'] == 'video' or 'video' in part %}"
        "<|vision_start|><|video_pad|><|vision_end|>"
        "{% elif 'text' in part %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


CHAT_TEMPLATE = vision_chat_template("You are a helpful assistant.")

_CORPUS = [
    "a person is sitting at a desk in front of a laptop",
    "the camera shows a kitchen with a table and two chairs",
    "a red car drives past a white building on a sunny day",
    "describe what you see in this frame in one short sentence",
    "there is a cat on the sofa and a lamp next to the window",
    "the quick brown fox jumps over the lazy dog",
    "what changed since the previous frame? nothing much, the scene is still",
    "0 1 2 3 4 5 6 7 8 9 ten twenty hundred thousand",
    "You are a helpful assistant. Answer briefly.",
]


def build_bpe_tokenizer(
    out: Path,
    *,
    special_tokens: list[str],
    chat_template: str,
    eos_token: str,
    pad_token: str,
) -> None:
    """A byte-level BPE trained on the small corpus, padded with filler tokens so that every id
    below VOCAB_SIZE decodes (random weights sample any id), then `special_tokens` (their ids are
    the last ones); saved to `out` with `chat_template`. Shared by the tiny random VLMs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(special_tokens),
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    filler = [
        f"<|filler_{i}|>" for i in range(VOCAB_SIZE - len(special_tokens) - tok.get_vocab_size())
    ]
    if filler:
        tok.add_tokens(filler)
    tok.add_special_tokens(special_tokens)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos_token,
        pad_token=pad_token,
        unk_token=None,
    )
    fast.chat_template = chat_template
    fast.save_pretrained(str(out))


def qwen_tokenizer_and_ids(out: Path) -> tuple[Any, dict[str, int]]:
    """The tiny Qwen-VL models' tokenizer, saved to `out`, and the ids of its special tokens
    (shared by tiny-qwen2-vl, tiny-qwen2.5-vl and tiny-qwen3-vl)."""
    from transformers import AutoTokenizer

    out.mkdir(parents=True, exist_ok=True)
    build_bpe_tokenizer(
        out,
        special_tokens=SPECIAL_TOKENS,
        chat_template=CHAT_TEMPLATE,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tok = AutoTokenizer.from_pretrained(str(out))
    return tok, {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}


def build_tiny_vlm(out: Path) -> None:
    import torch
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    tok, ids = qwen_tokenizer_and_ids(out)
    text_config = {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [4, 6, 6],
        },
        "tie_word_embeddings": False,
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
    }
    vision_config = {
        "depth": 2,
        "embed_dim": 64,
        "hidden_size": 128,
        "num_heads": 2,
        "mlp_ratio": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
    }
    config = Qwen2VLConfig(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen2VLForConditionalGeneration"]
    torch.manual_seed(0)  # reproducible weights: tests compare exact token ids across runs
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(str(out))
    size = {"shortest_edge": 56 * 56, "longest_edge": 224 * 224}  # min/max pixels
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=size, patch_size=14, merge_size=2),
        video_processor=Qwen2VLVideoProcessor(size=size, patch_size=14, merge_size=2),
        tokenizer=tok,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(out))
    gen = {"eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]}
    (out / "generation_config.json").write_text(json.dumps(gen))
