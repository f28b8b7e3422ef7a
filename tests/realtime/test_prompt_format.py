"""Chunk prompts come from the model's chat format (realtime/prompt_format.py), without an engine.

The embedded models' prompts must stay byte-identical to the ChatML the server wrote before the
format was taken from the template: prefix caching and the recall tests depend on them.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
from typing import Any

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from realtime.engine_session import render_chunk
from realtime.hub import SessionHub
from realtime.models import CHATML, DEFAULT_MODELS, QWEN2_VL_CHATML, registered_chat_format
from realtime.models.tiny_vlm import CHAT_TEMPLATE as QWEN2_VL_TEMPLATE
from realtime.prompt_format import ChatFormat, ChatFormatError
from vllm_realtime_protocol import Frame, InvalidEvent, SessionConfig


def legacy_chunk(
    kind: str,
    text: str | None,
    prompt: str | None,
    *,
    instructions: str | None,
    first: bool,
    after_reply: bool,
    reply: bool,
) -> str:
    """The chunk text as render_chunk wrote it with hard-coded ChatML (the reference)."""
    parts: list[str] = []
    if first:
        if instructions:
            parts.append(f"<|im_start|>system\n{instructions}<|im_end|>\n")
    elif after_reply:
        parts.append("<|im_end|>\n")
    parts.append("<|im_start|>user\n")
    if kind == "image":
        parts.append("<|vision_start|><|image_pad|><|vision_end|>")
    elif kind == "video":
        parts.append("<|vision_start|><|video_pad|><|vision_end|>")
    else:
        parts.append(text or "")
    if prompt:
        parts.append(("\n" if kind == "text" else "") + prompt)
    parts.append("<|im_end|>\n")
    if reply:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def jpeg() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (28, 28), (200, 30, 30)).save(buf, format="JPEG")
    return buf.getvalue()


COMBINATIONS = list(
    itertools.product(
        ["text", "image", "video"],  # kind
        [None, "What is on the desk?"],  # prompt
        [None, "You watch a camera."],  # instructions
        [True, False],  # first
        [True, False],  # after_reply
        [True, False],  # reply
    )
)


@pytest.mark.parametrize(
    ("kind", "prompt", "instructions", "first", "after_reply", "reply"), COMBINATIONS
)
def test_chunks_are_byte_identical_to_the_hard_coded_chatml(
    kind: str,
    prompt: str | None,
    instructions: str | None,
    first: bool,
    after_reply: bool,
    reply: bool,
) -> None:
    text = "Frame 3: the hallway is empty." if kind == "text" else None
    want = legacy_chunk(
        kind,
        text,
        prompt,
        instructions=instructions,
        first=first,
        after_reply=after_reply,
        reply=reply,
    )
    content = (text or "") + (("\n" if kind == "text" else "") + prompt if prompt else "")
    got = QWEN2_VL_CHATML.chunk(
        content,
        media=None if kind == "text" else kind,  # type: ignore[arg-type]
        instructions=instructions if first else None,
        close_reply=after_reply and not first,
        reply=reply,
    )
    assert got == want
    if kind == "video":
        return  # render_chunk decodes the media; a clip is exercised by the server tests
    frame = Frame(
        frame_index=3,
        frame_id=None,
        kind=kind,  # type: ignore[arg-type]
        media_format="jpeg" if kind == "image" else None,
        data=jpeg() if kind == "image" else (text or "").encode(),
        text=text,
        prompt=prompt,
        timestamp=None,
        reply=reply,
    )
    config = SessionConfig(instructions=instructions, modality="video")
    for chat in (QWEN2_VL_CHATML, CHATML) if kind == "text" else (QWEN2_VL_CHATML,):
        rendered = render_chunk(
            frame, config, chat=chat, first=first, multimodal=True, after_reply=after_reply
        )
        assert rendered["prompt"] == want
        assert ("multi_modal_data" in rendered) == (kind == "image")


def jinja_renderer(template: str, **context: Any) -> Any:
    """Renders as transformers' apply_chat_template does (same environment options)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    compiled = env.from_string(template)

    def render(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **context
        )

    return render


def test_the_qwen2_vl_template_splits_into_the_registered_format() -> None:
    # The templates write Qwen's default system turn; the registered formats leave it out (the
    # embedded models' prompts stay what they were measured with, see tests/test_models.py).
    qwen = ChatFormat.from_template(jinja_renderer(QWEN2_VL_TEMPLATE))
    assert qwen.preamble == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    assert dataclasses.replace(qwen, preamble="") == QWEN2_VL_CHATML
    smol = DEFAULT_MODELS["smol-qwen2-vl"]
    from realtime.models.smol_vlm import CHAT_TEMPLATE as SMOL_TEMPLATE

    got = ChatFormat.from_template(jinja_renderer(SMOL_TEMPLATE))
    assert dataclasses.replace(got, preamble="") == smol.chat_format


LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def test_a_llama3_style_template_and_the_bos_the_tokenizer_adds() -> None:
    render = jinja_renderer(LLAMA3, bos_token="<|begin_of_text|>")
    chat = ChatFormat.from_template(render, strip_prefix="<|begin_of_text|>")
    assert chat == ChatFormat(
        system_open="<|start_header_id|>system<|end_header_id|>\n\n",
        system_close="<|eot_id|>",
        user_open="<|start_header_id|>user<|end_header_id|>\n\n",
        user_close="<|eot_id|>",
        assistant_open="<|start_header_id|>assistant<|end_header_id|>\n\n",
        assistant_close="<|eot_id|>",
    )  # a string-only template: no media placeholders, text sessions only
    # Without a tokenizer that adds it, the BOS stays in the first turn's opening.
    assert ChatFormat.from_template(render).system_open.startswith("<|begin_of_text|>")


@pytest.mark.parametrize(
    "template",
    [
        # No system role (Gemma-like): it raises on a system message.
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}",
        # Every message's content written twice.
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ m['content'] }}{% endfor %}",
        # No delimiters at all.
        "{% for m in messages %}{{ m['content'] }}{% endfor %}",
        # The last assistant turn rendered unlike the others (the close depends on position).
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
        "{% if not loop.last %}<|end|>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    ],
)
def test_a_template_that_does_not_split_is_refused_not_guessed(template: str) -> None:
    with pytest.raises(ChatFormatError):
        ChatFormat.from_template(jinja_renderer(template))


def test_the_registry_knows_the_embedded_models_by_name_only() -> None:
    assert registered_chat_format("tiny-qwen2-vl") == QWEN2_VL_CHATML
    assert registered_chat_format("smollm2-135m-instruct") == CHATML
    assert registered_chat_format("/nowhere/some-hub-model") is None
    assert CHATML.image is None and CHATML.video is None


def test_a_frame_for_a_format_without_its_placeholder_is_refused() -> None:
    frame = Frame(0, None, "image", "jpeg", jpeg(), None, None, None)
    with pytest.raises(InvalidEvent, match="no image"):
        render_chunk(frame, SessionConfig(), chat=CHATML, first=True, multimodal=True)
    # ... and a video session on such a model is refused at session.open.
    hub = object.__new__(SessionHub)  # only what ensure_text_or_video reads
    hub.multimodal, hub.model_name, hub._chat = True, "some-vlm", CHATML
    with pytest.raises(InvalidEvent, match="image placeholder"):
        hub.ensure_text_or_video(SessionConfig(modality="video"))
    hub.ensure_text_or_video(SessionConfig(modality="text"))
    hub._chat = QWEN2_VL_CHATML
    hub.ensure_text_or_video(SessionConfig(modality="video"))
