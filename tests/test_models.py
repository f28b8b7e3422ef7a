"""The embedded default models: built locally, loadable, and served by vLLM like transformers."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from realtime.models import DEFAULT_MODELS, build_model, is_built, model_dir


def test_every_default_model_builds_once_and_is_reused() -> None:
    for name in DEFAULT_MODELS:
        path = build_model(name)
        assert is_built(name)
        stamp = (path / "config.json").stat().st_mtime_ns
        assert build_model(name) == path  # second call reuses, does not rebuild
        assert (path / "config.json").stat().st_mtime_ns == stamp


def test_smollm2_config_is_the_real_model() -> None:
    cfg = json.loads((model_dir("smollm2-135m-instruct") / "config.json").read_text())
    # SmolLM2-135M: 30 layers, hidden 576, 9/3 heads, 8192 positions, rope_theta 1e5.
    assert (cfg["num_hidden_layers"], cfg["hidden_size"]) == (30, 576)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (9, 3)
    assert cfg["max_position_embeddings"] == 8192
    assert cfg["rope_theta"] == 100000.0


def test_tiny_vlm_processor_tokens() -> None:
    from PIL import Image
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(str(model_dir("tiny-qwen2-vl")))
    tok = proc.tokenizer
    assert len(tok) == 1024  # padded so every sampled id decodes
    for special in (
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|image_pad|>",
        "<|video_pad|>",
    ):
        assert tok.convert_tokens_to_ids(special) < 1024
    image = Image.new("RGB", (112, 112), (120, 30, 200))
    text = "<|vision_start|><|image_pad|><|vision_end|>hi"
    out = proc(text=[text], images=[image], return_tensors="pt")
    # 112×112 → 8×8 patches of 14 px → 2×2 merge → 16 LLM tokens.
    n_pad = int((out["input_ids"] == tok.convert_tokens_to_ids("<|image_pad|>")).sum())
    assert n_pad == 16


PROMPTS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write one sentence about the sea.",
]


@pytest.mark.slow
async def test_vllm_greedy_equals_transformers_greedy_on_smollm2(smollm2_engine) -> None:  # type: ignore[no-untyped-def]
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    path = str(model_dir("smollm2-135m-instruct"))
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    params = SamplingParams(max_tokens=12, temperature=0.0)
    answers = []
    for prompt in PROMPTS:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0][
                len(ids) :
            ]
        final = None
        async for out in smollm2_engine.generate(
            TokensPrompt(prompt_token_ids=ids), params, request_id=uuid.uuid4().hex
        ):
            final = out
        assert final is not None
        got = list(final.outputs[0].token_ids)
        want = ref.tolist()[: len(got)]
        assert got == want, (prompt, tok.decode(got), tok.decode(want))
        answers.append(tok.decode(got))
    # The real model answers: the converted weights are not noise.
    assert "Paris" in answers[0]


@pytest.mark.parametrize("name", sorted(DEFAULT_MODELS))
def test_registered_chat_format_is_what_the_chat_template_gives(name: str) -> None:
    """The server writes an embedded model's chunks with its registered format; the same model
    served by path with its template alone would get the same prompts, but for the template's
    default system turn (the preamble), which the registered formats leave out so that the
    embedded models' prompts stay what their tests and recall figures were measured with."""
    import dataclasses

    from transformers import AutoTokenizer

    from realtime.models import registered_chat_format
    from realtime.prompt_format import ChatFormat

    path = build_model(name)
    tok = AutoTokenizer.from_pretrained(str(path))

    def render(messages: list[dict[str, object]], add_generation_prompt: bool) -> str:
        text = tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return str(text)

    got = ChatFormat.from_template(render)
    assert dataclasses.replace(got, preamble="") == DEFAULT_MODELS[name].chat_format
    assert registered_chat_format(str(path)) == DEFAULT_MODELS[name].chat_format


def test_a_model_built_from_other_packaged_weights_is_not_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The cache is keyed by name; the marker records the packaged weights it was built from, so
    # a checkout that ships new tower weights rebuilds `smol-qwen2-vl` instead of serving old ones.
    from realtime.models import _MARKER, _marker_text

    monkeypatch.setenv("VLLM_REALTIME_HOME", str(tmp_path))
    built = model_dir("smol-qwen2-vl")
    assert tmp_path in built.parents
    built.mkdir(parents=True)
    (built / _MARKER).write_text("ok\n")  # a build from before the marker held a digest
    assert not is_built("smol-qwen2-vl")
    (built / _MARKER).write_text(_marker_text(DEFAULT_MODELS["smol-qwen2-vl"]))
    assert is_built("smol-qwen2-vl")
    (model_dir("tiny-qwen2-vl")).mkdir(parents=True)
    (model_dir("tiny-qwen2-vl") / _MARKER).write_text("ok\n")  # no packaged inputs: any marker
    assert is_built("tiny-qwen2-vl")


@pytest.mark.parametrize("name", ["tiny-qwen3-vl", "tiny-qwen2.5-vl"])
def test_tiny_qwen_vl_families_process_images_and_clips_as_their_family_does(name: str) -> None:
    import numpy as np
    from PIL import Image
    from transformers import AutoConfig, AutoProcessor

    path = str(build_model(name))
    proc = AutoProcessor.from_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    tok = proc.tokenizer
    assert len(tok) == 1024  # tiny_vlm's tokenizer: padded so every sampled id decodes
    image = Image.new("RGB", (112, 112), (120, 30, 200))
    out = proc(text=["<|vision_start|><|image_pad|><|vision_end|>"], images=[image])
    # Qwen3-VL: 112 -> 128 px, 8×8 patches of 16; Qwen2.5-VL: 8×8 patches of 14; 2×2 merge.
    assert out["input_ids"][0].count(config.image_token_id) == 16
    clip = np.zeros((4, 112, 112, 3), dtype=np.uint8)
    metadata = {"fps": 0.5, "duration": 8.0, "total_num_frames": 4, "frames_indices": [0, 1, 2, 3]}
    out = proc(
        text=["<|vision_start|><|video_pad|><|vision_end|>"],
        videos=[clip],
        video_metadata=[metadata],
        do_sample_frames=False,
    )
    ids = out["input_ids"][0]
    assert ids.count(config.video_token_id) == 32  # 2 temporal patches of 16
    if name == "tiny-qwen3-vl":
        assert config.text_config.rope_parameters["mrope_interleaved"]
        assert config.vision_config.deepstack_visual_indexes == [0, 1]
        # Each temporal patch is introduced by its timestamp, written as text.
        assert "<1.0 seconds>" in tok.decode(ids) and "<5.0 seconds>" in tok.decode(ids)
    else:
        # A clip's temporal positions are scaled by 2 / fps × tokens_per_second = 16.
        assert [float(s) for s in out["second_per_grid_ts"]] == [4.0]
        assert config.vision_config.tokens_per_second == 4
