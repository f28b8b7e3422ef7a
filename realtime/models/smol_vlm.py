"""A small vision-language model whose replies mean something: SmolLM2-135M behind a vision tower
trained here on synthetic frames.

Theory of operation. The language model is the real SmolLM2-135M-Instruct (Llama), placed
unchanged into the Qwen2-VL language model: Qwen2 attention is Llama attention plus q/k/v biases
(set to zero), and mRoPE rotates text tokens with the same position on all three sections, so for
text-only prompts the model computes exactly what SmolLM2 computes (tested: greedy equality
through vLLM). The vision tower and merger are a small Qwen2-VL encoder trained on CPU
(`training/vision_train.py`) to emit, for each merged 28×28-pixel patch, the SmolLM2 input
embedding of a word describing what is there ("green" on a green background, "red" and "circle" on
a red circle, ...): the language model then reads a frame as a handful of words. Its trained
weights (fp16, a few MB) ship in the package (`data/smol_vlm_vision.safetensors`), so a build only
assembles files: no training at build time.

The tokenizer is SmolLM2's with five unused special tokens of its code-data vocabulary
(`<repo_name>` … `<gh_stars>`) renamed to Qwen2-VL's vision tokens, so the vocabulary, the
embedding and the tied `lm_head` stay exactly SmolLM2's. `<|im_start|>`/`<|im_end|>` are already
SmolLM2's chat tokens. The processor keeps frames small: at most 112×112 pixels, so a square frame
is 16 language-model tokens and a 4:3 webcam frame 12.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from realtime.models.tiny_vlm import vision_chat_template

# SmolLM2 special ids 3..7 are code-data markers never used in chat; they become Qwen's vision
# tokens (same ids, new names).
RENAMED_TOKENS = {
    3: "<|vision_start|>",
    4: "<|vision_end|>",
    5: "<|vision_pad|>",
    6: "<|image_pad|>",
    7: "<|video_pad|>",
}
MIN_PIXELS = 56 * 56
MAX_PIXELS = 112 * 112
PATCH_SIZE = 14
MERGE_SIZE = 2
# head_dim 64 → 32 rotary frequencies, split into temporal/height/width in Qwen2-VL's proportion
# (16/24/24 of 64 for head_dim 128). Text tokens carry one position on all three, i.e. 1D RoPE.
MROPE_SECTION = [8, 12, 12]
VISION_CONFIG: dict[str, Any] = {
    "depth": 4,
    "embed_dim": 128,
    "hidden_size": 576,  # the merger's output: SmolLM2's hidden size
    "num_heads": 4,
    "mlp_ratio": 2,
    "patch_size": PATCH_SIZE,
    "spatial_merge_size": MERGE_SIZE,
    "temporal_patch_size": 2,
    "in_channels": 3,
}
VISION_WEIGHTS = Path(__file__).parent / "data" / "smol_vlm_vision.safetensors"

# Qwen2-VL's template, trimmed to what the service renders (as in tiny_vlm), with SmolLM2's own
# default system prompt.
CHAT_TEMPLATE = vision_chat_template(
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
)


def _rename_tokens(src: Path, out: Path) -> None:
    """SmolLM2's tokenizer.json with ids 3..7 renamed (vocabulary size unchanged)."""
    data = json.loads((src / "tokenizer.json").read_text())
    for tok in data["added_tokens"]:
        if tok["id"] in RENAMED_TOKENS:
            tok["content"] = RENAMED_TOKENS[tok["id"]]
    vocab = data["model"]["vocab"]
    for old in [k for k, v in vocab.items() if v in RENAMED_TOKENS]:
        del vocab[old]
    for i, name in RENAMED_TOKENS.items():
        vocab[name] = i
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))


def lm_config(src: Path) -> dict[str, Any]:
    """The Qwen2-VL text config that reproduces SmolLM2 (read from its built config)."""
    cfg = json.loads((src / "config.json").read_text())
    return {
        "vocab_size": cfg["vocab_size"],
        "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"],
        "max_position_embeddings": cfg["max_position_embeddings"],
        "rms_norm_eps": cfg["rms_norm_eps"],
        "hidden_act": "silu",
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": cfg["rope_theta"],
            "mrope_section": MROPE_SECTION,
        },
        "tie_word_embeddings": True,
        "bos_token_id": cfg["bos_token_id"],
        "eos_token_id": cfg["eos_token_id"],
        "pad_token_id": cfg["pad_token_id"],
    }


def build_smol_vlm(out: Path, smollm2_dir: Path, vision_weights: Path | None = None) -> None:
    """Assemble the model in `out` from the built SmolLM2 and the trained vision weights
    (`vision_weights`; None = the packaged file; a missing file = random tower, for training)."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import (
        AutoTokenizer,
        PreTrainedTokenizerFast,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    out.mkdir(parents=True, exist_ok=True)
    text = lm_config(smollm2_dir)
    ids = {name: i for i, name in RENAMED_TOKENS.items()}
    config = {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "text_config": {"model_type": "qwen2_vl_text", **text},
        "vision_config": {"model_type": "qwen2_vl_vision", **VISION_CONFIG},
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": True,
        "dtype": "float32",
    }
    # Weights: SmolLM2's (Llama names → Qwen2-VL names), zero q/k/v biases, the vision tower.
    lm = load_file(str(smollm2_dir / "model.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for name, w in lm.items():
        assert name.startswith("model."), name
        tensors["model.language_model." + name[len("model.") :]] = w.to(torch.float32)
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            bias = name[: -len("weight")] + "bias"
            tensors["model.language_model." + bias[len("model.") :]] = torch.zeros(w.shape[0])
    path = VISION_WEIGHTS if vision_weights is None else vision_weights
    vision = load_file(str(path)) if path.exists() else random_vision_weights()
    for name, w in vision.items():
        tensors["model.visual." + name] = w.to(torch.float32).contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen = {"bos_token_id": text["bos_token_id"], "eos_token_id": text["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(gen))

    _rename_tokens(smollm2_dir, out)
    src_cfg = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(out / "tokenizer.json"),
        bos_token=src_cfg.get("bos_token") or "<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(out))
    tok = AutoTokenizer.from_pretrained(str(out))
    size = {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS}  # min/max pixels
    processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(
            size=size, patch_size=PATCH_SIZE, merge_size=MERGE_SIZE
        ),
        video_processor=Qwen2VLVideoProcessor(
            size=size, patch_size=PATCH_SIZE, merge_size=MERGE_SIZE
        ),
        tokenizer=tok,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(str(out))


def vision_model(weights: dict[str, Any] | None = None) -> Any:
    """The Qwen2-VL vision tower + merger of this model, as a transformers module."""
    import torch
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VisionTransformerPretrainedModel,
    )

    cfg = Qwen2VLConfig(vision_config=VISION_CONFIG).vision_config
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = Qwen2VisionTransformerPretrainedModel(cfg).to(torch.float32)
    if weights is not None:
        model.load_state_dict(weights)
    return model


def random_vision_weights() -> dict[str, Any]:
    return {k: v.detach().clone() for k, v in vision_model().state_dict().items()}
