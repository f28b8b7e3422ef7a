"""A tiny random-weight Llama (1D RoPE), built in about a second: the self-check's model.

Sizes: hidden 128, 2 layers, 4/2 heads (head_dim 32, the CPU attention minimum), a 1,024-token
byte-level BPE vocabulary (tiny_vlm's tokenizer with ChatML's special tokens). The weights are
drawn wider than a trained model's initialisation (INIT_RANGE) so that attention is sharp: a
token at a wrong position, a stale block or a wrong mask moves the next-token log-probs by far
more than the oracle's tolerance, which near-uniform outputs would hide.
"""

from __future__ import annotations

import json
from pathlib import Path

from realtime.models.tiny_vlm import VOCAB_SIZE, build_bpe_tokenizer

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
INIT_RANGE = 0.2
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_llama(out: Path, seed: int = 0) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    build_bpe_tokenizer(
        out,
        special_tokens=SPECIAL_TOKENS,
        chat_template=CHAT_TEMPLATE,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=INIT_RANGE,
        tie_word_embeddings=False,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)  # reproducible weights: the same model on every machine
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(out))
    gen = {"eos_token_id": ids["<|im_end|>"], "pad_token_id": ids["<|endoftext|>"]}
    (out / "generation_config.json").write_text(json.dumps(gen))
