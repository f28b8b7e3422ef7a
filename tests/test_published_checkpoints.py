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
from tests.published_layouts import (
    PUBLISHED,
    compare_prompt,
    published_template,
    template_format,
    tokenizer,
)

FRAMES = [(224, 224), (640, 480), (1280, 720)]


@pytest.mark.parametrize("instructions", [None, "Describe each frame."])
@pytest.mark.parametrize(
    "family", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl", "smolvlm", "smolvlm2", "smollm2"]
)
def test_the_prompt_equals_the_templates_own(family: str, instructions: str | None) -> None:
    """system + frame + reply + frame, as the server writes it (each chunk tokenized on its
    own, as the engine gets it), against `apply_chat_template` of the same conversation."""
    compared = compare_prompt(family, instructions)
    assert compared.ours == compared.templates
    assert compared.our_ids == compared.template_ids
    if instructions is None and family != "qwen3-vl":
        # The template's default system turn (Qwen2-VL's "You are a helpful assistant.",
        # SmolLM2's own) or its conversation opening (SmolVLM's one `<|im_start|>`).
        chat = compared.chat
        assert chat.preamble and compared.templates.startswith(chat.preamble)


def test_the_smolvlm_template_splits() -> None:
    chat, _ = template_format(tokenizer("tiny-smolvlm"), published_template("smolvlm"))
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
    kwargs.pop("video_sampling", None)  # SmolVLM2's clip sampling: its video processor's
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


@pytest.mark.parametrize("family", ["smolvlm", "smolvlm2"])
def test_smolvlm_caps_come_from_the_preprocessor_config(family: str) -> None:
    """SmolVLM-256M's layout and SmolVLM2-256M/500M-Video's (the same tiles and edge; its
    preprocessor config also carries the clip sampling, `video_sampling`)."""
    config = read_processor_config(str(PUBLISHED / family))
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
    only = json.loads((PUBLISHED / family / "processor_config.json").read_text())
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

    template = published_template("smolvlm")
    path = tmp_path / "t.jinja"
    path.write_text(template)
    assert load_chat_template(str(path)) == template
    assert load_chat_template(template) == template  # vLLM's flag takes either
    with pytest.raises(ChatFormatError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def _qwen_clip_grid(family: str, frames: int, size: tuple[int, int], cap: int) -> list[int]:
    """The published video processor's own grid (t, h, w) for a clip of `frames` frames of
    `size`, decoded as the server decodes a clip (each frame resized to the cap) and the
    processor told the cap as the server tells it (`mm_processor_kwargs`, the images' and the
    clips' alike)."""
    import numpy as np
    from transformers import AutoVideoProcessor

    from realtime.media import decode_clip
    from tests.reliability.fuzzcore import _clip

    layout = PUBLISHED / family
    config = read_processor_config(str(layout))
    processor = AutoVideoProcessor.from_pretrained(str(layout))
    data = _clip("mp4", "mpeg4", frames=frames, size=size[0])
    clip, metadata = decode_clip(data, max_frame_pixels=cap)
    assert clip.shape[0] == frames and clip.shape[1] * clip.shape[2] <= cap
    over = processor_kwargs(config, cap) or {}
    # The metadata as vLLM hands it to the processor: its own sampling flag kept apart.
    fields = {k: v for k, v in metadata.items() if k != "do_sample_frames"}
    out = processor(
        videos=[clip], video_metadata=[fields], do_sample_frames=False, return_tensors="np", **over
    )
    return [int(v) for v in np.asarray(out["video_grid_thw"][0])]


@pytest.mark.parametrize("family", ["qwen2-vl", "qwen2.5-vl", "qwen3-vl"])
def test_a_clip_reserves_what_the_published_video_processor_makes(family: str) -> None:
    """A clip through the published video processor config (Qwen3-VL's own
    video_preprocessor_config.json, 25 megapixels; Qwen2-VL's and Qwen2.5-VL's shared one) at
    the default frame cap: its tokens per temporal step are within the reservation, and
    the reservation bounds them. The tokens of a clip are what the server's prompt expands (its grid)."""
    config = read_processor_config(str(PUBLISHED / family))
    cap = DEFAULT_MAX_FRAME_PIXELS
    bounds = media_bounds(config, cap)
    assert bounds is not None
    merge = int(config["video_processor"]["merge_size"]) ** 2
    steps = {}
    for frames, side in [(4, 640), (2, 448), (2, 224)]:
        t, h, w = _qwen_clip_grid(family, frames, (side, side), cap)
        assert t == frames // bounds.temporal_patch, (t, frames)
        steps[side] = h * w // merge
        assert steps[side] <= bounds.clip_frame_tokens, (family, side, steps, bounds)
        assert bounds.clip_tokens(frames) >= t * steps[side]
    # Not within 2×: Qwen3-VL's video processor spreads its pixel budget over the clip's
    # frames (a 640-px clip of 4 frames is 49 tokens a step against 196 reserved).


def test_the_docs_table_is_what_the_command_prints() -> None:
    """docs/published-checkpoints.md holds `python -m tests.published_layouts`'s table: every
    published VLM layout bounded at the default cap, every prompt the template's."""
    from tests.published_layouts import table, table_rows

    page = (Path(__file__).resolve().parents[1] / "docs" / "published-checkpoints.md").read_text()
    assert table() in page
    for row in table_rows():
        assert row[1].startswith("yes") and "whole context" not in row[4], row
        assert row[5] == "yes / yes", row
