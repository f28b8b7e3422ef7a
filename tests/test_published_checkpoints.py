"""Published checkpoints as their users run them (issue #47), without an engine: the published
chat templates and processor configs (tests/published/, sources named in its README) on the
families' tiny models.

* the prompt the server writes, chunk by chunk, equals the template's own rendering of the
  same conversation, token for token, with and without instructions (the default system turn);
* a frame's reservation under the frame cap bounds the processor's own token count for 224 px,
  640×480 and 1280×720 frames, within 2× for a camera frame;
* the processor config is read from the published layout (SmolVLM's caps are in
  preprocessor_config.json, processor_config.json holds only `image_seq_len`).

The engine tests on these layouts are in tests/test_serve_model_dir.py.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

from realtime.admission import media_bounds, processor_kwargs
from realtime.engine_session import read_processor_config
from realtime.media import DEFAULT_MAX_FRAME_PIXELS, fit_size
from realtime.models import build_model
from realtime.prompt_format import ChatFormat
from tests.published_checkpoints import FAMILIES, PUBLISHED

FRAMES = [(224, 224), (640, 480), (1280, 720)]


def _template(family: str) -> str:
    return (PUBLISHED / "templates" / FAMILIES[family][1]).read_text()


def _tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(build_model(name)))


def _format(tok: Any, template: str) -> tuple[ChatFormat, Any]:
    def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return str(
            tok.apply_chat_template(
                messages,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
        )

    return ChatFormat.from_template(render), render


def _parts(text: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": text}]


@pytest.mark.parametrize("instructions", [None, "Describe each frame."])
@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "smolvlm", "smollm2"])
def test_the_prompt_equals_the_templates_own(family: str, instructions: str | None) -> None:
    """system + frame + reply + frame, as the server writes it (each chunk tokenized on its
    own, as the engine gets it), against `apply_chat_template` of the same conversation."""
    if family == "smollm2":  # a text model: its own template (from the GGUF), text turns
        tok = _tokenizer("smollm2-135m-instruct")
        template = tok.chat_template
        media = None
    else:
        tok = _tokenizer(FAMILIES[family][0])
        template = _template(family)
        media = "image"
    chat, render = _format(tok, template)
    reply = "a red square"
    # The reply fills the generation prompt: SmolVLM's is `Assistant:` and a past reply's
    # opening `Assistant: `, so the model writes the space itself.
    generated = (" " if family == "smolvlm" else "") + reply
    first = chat.chunk(
        "what is this?", media=media, instructions=instructions, first=True, reply=True
    )
    second = chat.chunk("and now?", media=media, close_reply=True, reply=True)

    def user(text: str) -> dict[str, Any]:
        content = ([{"type": "image"}] if media else []) + _parts(text)
        return {"role": "user", "content": content}

    messages = [
        *([{"role": "system", "content": _parts(instructions)}] if instructions else []),
        user("what is this?"),
        {"role": "assistant", "content": _parts(reply)},
        user("and now?"),
    ]
    if family == "smollm2":
        messages = [{**m, "content": m["content"][-1]["text"]} for m in messages]
    expected = render(messages, True)
    assert first + generated + second == expected

    def ids(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    assert ids(first) + ids(generated) + ids(second) == ids(expected)
    if instructions is None and family != "qwen3-vl":
        # The template's default system turn (Qwen2-VL's "You are a helpful assistant.",
        # SmolLM2's own) or its conversation opening (SmolVLM's one `<|im_start|>`).
        assert chat.preamble and expected.startswith(chat.preamble)


def test_the_smolvlm_template_splits() -> None:
    chat, _ = _format(_tokenizer("tiny-smolvlm"), _template("smolvlm"))
    assert chat == ChatFormat(
        system_open="<|im_start|>System: ",
        system_close="<end_of_utterance>\n",
        user_open="User: ",
        user_close="<end_of_utterance>\n",
        assistant_open="Assistant:",
        assistant_close="<end_of_utterance>\n",
        image="<image>",
        video=None,  # the template writes nothing for a clip
        preamble="<|im_start|>",  # the conversation is opened once
        media_user_open="User:",  # a turn that starts with an image: no space
    )


def _qwen_tokens(config: dict[str, Any], size: tuple[int, int], cap: int | None) -> int:
    """The Qwen-VL image processor's own token count for a frame of `size` resized as the
    server resizes it, the processor told the cap as the server tells it."""
    import numpy as np
    from transformers import Qwen2VLImageProcessor

    w, h = fit_size(*size, cap)
    kwargs = {k: v for k, v in config.items() if not k.endswith("_type") and k != "processor_class"}
    processor = Qwen2VLImageProcessor(**kwargs)
    image = np.zeros((h, w, 3), dtype=np.uint8)
    over = processor_kwargs(config, cap) or {}
    grid = processor(images=[image], return_tensors="np", **over)["image_grid_thw"][0]
    return int(np.prod(grid)) // int(config["merge_size"]) ** 2


def _smolvlm_tokens(config: dict[str, Any], size: tuple[int, int], cap: int | None = None) -> int:
    """The SmolVLM processor's own token count for a frame resized as the server resizes it,
    the processor told the cap as the server tells it: its prompt string's tokens."""
    import numpy as np
    from transformers import SmolVLMImageProcessor
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    image_config = config["image_processor"]
    kwargs = {k: v for k, v in image_config.items() if not k.endswith("_type")}
    kwargs.pop("processor_class", None)
    processor = SmolVLMImageProcessor(**kwargs)
    w, h = fit_size(*size, cap)
    image = np.zeros((h, w, 3), dtype=np.uint8)
    over = processor_kwargs(config, cap) or {}
    out = processor(images=[[image]], return_row_col_info=True, return_tensors="np", **over)
    prompt = get_image_prompt_string(
        out["rows"][0][0],
        out["cols"][0][0],
        config["image_seq_len"],
        fake_token_around_image="<fake_token_around_image>",
        image_token="<image>",
        global_image_token="<global-img>",
    )
    # Every special marker is one token, and each newline is one.
    return len(re.findall(r"<[^>]+>|\n", prompt))


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
def test_a_qwen_frame_reserves_what_the_processor_makes_under_the_cap(family: str) -> None:
    layout = PUBLISHED / family
    config = read_processor_config(str(layout))
    image = config["image_processor"]
    cap = DEFAULT_MAX_FRAME_PIXELS
    bounds = media_bounds(config, cap)
    assert bounds is not None
    uncapped = media_bounds(config)
    assert uncapped is not None and uncapped.image_tokens >= 12_845_056 // 32**2  # 12,544+
    for size in FRAMES:
        real = _qwen_tokens(image, size, cap)
        assert real <= bounds.image_tokens, (size, real, bounds)
    # A camera frame at the cap: the reservation is within 2× of what it really becomes.
    assert bounds.image_tokens <= 2 * _qwen_tokens(image, (640, 480), cap), bounds
    # Clips: each frame resized to the cap, a temporal step of two frames is one frame's tokens.
    assert bounds.clip_frame_tokens <= 2 * _qwen_tokens(image, (640, 480), cap)


def test_smolvlm_caps_come_from_the_preprocessor_config() -> None:
    config = read_processor_config(str(PUBLISHED / "smolvlm"))
    assert config["image_seq_len"] == 64 and config["image_processor"]["size"]
    uncapped = media_bounds(config)
    assert uncapped is not None
    # Uncapped, the processor upscales every frame's longest edge to 2,048 px: a square one is
    # 4×4 tiles of 512 and the global image, 16 × (64 + 2) + 4 row ends + 1 + 64 + 3 = 1,128.
    assert uncapped.image_tokens == 1128
    real = {size: _smolvlm_tokens(config, size) for size in FRAMES}
    assert real == {(224, 224): 1128, (640, 480): 863, (1280, 720): 863}, real
    # Under the default cap (448×448) it is told a 512-px edge: one tile, the global image.
    bounds = media_bounds(config, DEFAULT_MAX_FRAME_PIXELS)
    assert bounds is not None and bounds.image_tokens == 64 + 3
    capped = {size: _smolvlm_tokens(config, size, DEFAULT_MAX_FRAME_PIXELS) for size in FRAMES}
    assert set(capped.values()) == {67}, capped
    # A 1280×720 cap: a 1,024-px edge, 2×2 tiles.
    cap = 1280 * 720
    hd = media_bounds(config, cap)
    assert hd is not None and hd.image_tokens == 4 * 66 + 2 + 1 + 67
    for size in FRAMES:
        assert (
            _smolvlm_tokens(config, size, cap)
            <= hd.image_tokens
            <= 2 * max(_smolvlm_tokens(config, size, cap), 1)
        ), size
    # The old read took processor_config.json alone: no sizes, the 1,024-token default.
    only = json.loads((PUBLISHED / "smolvlm" / "processor_config.json").read_text())
    assert media_bounds(only) is None


def test_the_tiny_models_own_reservations_are_unchanged_by_the_cap() -> None:
    # The embedded configs are smaller than the cap: 64 tokens a frame as before (#47's
    # "a default camera session reserves about what the tiny config gives today").
    for name in ("tiny-qwen2-vl", "tiny-qwen3-vl"):
        config = read_processor_config(str(build_model(name)))
        bounds = media_bounds(config, DEFAULT_MAX_FRAME_PIXELS)
        assert bounds is not None and bounds.image_tokens == 64, (name, bounds)
        assert processor_kwargs(config, DEFAULT_MAX_FRAME_PIXELS) is None


@pytest.mark.parametrize("size", [(1280, 720), (4000, 30), (3, 2), (640, 480)])
def test_fit_size_keeps_the_aspect_under_the_cap(size: tuple[int, int]) -> None:
    cap = DEFAULT_MAX_FRAME_PIXELS
    w, h = fit_size(*size, cap)
    assert w * h <= cap and w >= 1 and h >= 1
    if size[0] * size[1] <= cap:
        assert (w, h) == size
    else:
        assert math.isclose(w / h, size[0] / size[1], rel_tol=0.02)


def test_chat_template_is_a_file_or_the_template_itself(tmp_path: Path) -> None:
    from realtime.engine_session import load_chat_template
    from realtime.prompt_format import ChatFormatError

    template = _template("smolvlm")
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert load_chat_template(str(path)) == template
    assert load_chat_template(template) == template  # vLLM's flag takes either
    with pytest.raises(ChatFormatError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))
