"""Published checkpoints' layouts on the families' tiny models (issue #47), shared by the tests
and by the table in docs/published-checkpoints.md, which this module prints:

    PYTHONPATH=$PWD:$PWD/clients/python .venv/bin/python -m tests.published_layouts

Per family: the published chat template (tests/published/templates/) and processor configs
(tests/published/<family>/, sources in tests/published/README.md) put on the family's tiny
model; what a default camera session reserves under them against the tiny model's own config;
whether the prompt the server writes equals the template's own rendering, token for token.
No engine runs here: start-up is proven by tests/test_serve_model_dir.py, which the table
names; the table checks the steps of start-up that refused published checkpoints before (the
template splits into turns, the processor config gives the media caps).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.capacity import PAGE_INSTRUCTIONS
from realtime.admission import Admission, media_bounds, media_bounds_or_default
from realtime.config import ServerConfig
from realtime.engine_session import read_processor_config
from realtime.media import DEFAULT_MAX_FRAME_PIXELS
from realtime.models import build_model, registered_chat_format
from realtime.prompt_format import ChatFormat, ChatFormatError
from vllm_realtime_protocol import SessionConfig

PUBLISHED = Path(__file__).resolve().parent / "published"

# family -> (tiny model it is put on, template file)
FAMILIES = {
    "qwen2-vl": ("tiny-qwen2-vl", "qwen2_5_vl.jinja"),
    "qwen2.5-vl": ("tiny-qwen2.5-vl", "qwen2_5_vl.jinja"),
    "qwen3-vl": ("tiny-qwen3-vl", "qwen3_vl.jinja"),
    "smolvlm": ("tiny-smolvlm", "smolvlm.jinja"),
    "smolvlm2": ("tiny-smolvlm", "smolvlm.jinja"),
}
SMOL_FAMILIES = ("smolvlm", "smolvlm2")
NAMES = {
    "qwen2-vl": "Qwen2-VL",
    "qwen2.5-vl": "Qwen2.5-VL",
    "qwen3-vl": "Qwen3-VL",
    "smolvlm": "SmolVLM",
    "smolvlm2": "SmolVLM2",
    "smollm2": "SmolLM2",
}
# The engine test that serves each family's published layout.
SERVED_BY = {
    "qwen2-vl": "test_a_published_qwen_layout_serves_bounded_camera_sessions",
    "qwen2.5-vl": "test_a_published_qwen_layout_serves_bounded_camera_sessions",
    "qwen3-vl": "test_a_published_qwen_layout_serves_bounded_camera_sessions",
    "smolvlm": "test_a_published_smolvlm_256m_layout_is_served_end_to_end[smolvlm]",
    "smolvlm2": "test_a_published_smolvlm_256m_layout_is_served_end_to_end[smolvlm2]",
    "smollm2": "the embedded smollm2-135m-instruct (the real checkpoint)",
}
# What admission is given when nothing else is known: the tiny models' 4,096 positions and the
# CPU engine's 32-token blocks (realtime/engine.py).
MAX_POSITION = 4096
BLOCK_SIZE = 32


def published_checkpoint(family: str, out: Path) -> Path:
    """The family's tiny model with the published template and processor configs: a
    checkpoint laid out as a published one (the embedded model's nested processor config
    removed). The SmolVLM families' tiny model is built with SmolVLM-256M's vision geometry
    (`published_smolvlm`): tiny-smolvlm's 32-px tiles cannot take the published 512-px ones."""
    if family in SMOL_FAMILIES:
        return published_smolvlm(out, family)
    tiny = FAMILIES[family][0]
    checkpoint = out / f"published-{family}"
    shutil.copytree(build_model(tiny), checkpoint)
    _put_published_files(checkpoint, family)
    return checkpoint


def published_smolvlm(out: Path, family: str = "smolvlm") -> Path:
    """A tiny SmolVLM with the published checkpoints' vision geometry (512-px tiles, patch 16,
    scale factor 4: 64 tokens a tile; SmolVLM-256M and SmolVLM2-256M/500M share it), carrying
    the family's published template and processor configs."""
    from realtime.models.tiny_smolvlm import build_tiny_smolvlm

    checkpoint = out / f"published-{family}-256m"
    build_tiny_smolvlm(checkpoint, tile=512, longest_edge=2048, patch=16, scale_factor=4)
    _put_published_files(checkpoint, family)
    return checkpoint


def published_smolvlm_256m(out: Path) -> Path:
    return published_smolvlm(out, "smolvlm")


def _put_published_files(checkpoint: Path, family: str) -> None:
    (checkpoint / "processor_config.json").unlink()
    for path in (PUBLISHED / family).iterdir():
        if path.suffix == ".json":
            shutil.copy(path, checkpoint / path.name)
    template = PUBLISHED / "templates" / FAMILIES[family][1]
    shutil.copy(template, checkpoint / "chat_template.jinja")


def published_template(family: str) -> str:
    return (PUBLISHED / "templates" / FAMILIES[family][1]).read_text()


def tokenizer(name: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(build_model(name)))


def template_format(tok: Any, template: str) -> tuple[ChatFormat, Any]:
    """The chat format split from `template` (as the server splits it) and its renderer."""

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


@dataclass(frozen=True)
class PromptComparison:
    """The server's prompt (chunk by chunk) and the template's own, as text and token ids."""

    ours: str
    templates: str
    our_ids: list[int]
    template_ids: list[int]
    chat: ChatFormat

    @property
    def equal(self) -> bool:
        return self.ours == self.templates and self.our_ids == self.template_ids


def compare_prompt(family: str, instructions: str | None) -> PromptComparison:
    """system + frame + reply + frame, as the server writes it (each chunk tokenized on its
    own, as the engine gets it), against `apply_chat_template` of the same conversation."""
    if family == "smollm2":  # a text model: its own template (from the GGUF), text turns
        tok = tokenizer("smollm2-135m-instruct")
        template = tok.chat_template
        media = None
    else:
        tok = tokenizer(FAMILIES[family][0])
        template = published_template(family)
        media = "image"
    chat, render = template_format(tok, template)
    reply = "a red square"
    # The reply fills the generation prompt: SmolVLM's is `Assistant:` and a past reply's
    # opening `Assistant: `, so the model writes the space itself.
    generated = (" " if family in SMOL_FAMILIES else "") + reply
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

    def ids(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    return PromptComparison(
        ours=first + generated + second,
        templates=expected,
        our_ids=ids(first) + ids(generated) + ids(second),
        template_ids=ids(expected),
        chat=chat,
    )


@dataclass(frozen=True)
class Reservation:
    blocks: int
    tokens: int
    bounded: bool


def camera_session(video: bool) -> SessionConfig:
    """The default camera session: what the page opens (realtime/static/app.js) and
    bench.capacity --camera sends, its defaults (window 4, replies of 8 tokens)."""
    return SessionConfig(
        modality="video" if video else "text",
        instructions=PAGE_INSTRUCTIONS,
        retention={"window_chunks": 4},
        sampling={"max_tokens": 8},
    )


def camera_reservation(
    processor_config: dict[str, Any] | None,
    max_frame_pixels: int | None,
    *,
    opening_tokens: int,
) -> Reservation:
    """What admission reserves for the default camera session, as the hub admits it: the
    frame cap applied to the processor config (None: a text model), `opening_tokens` (its
    instructions' system turn) counted as the hub counts it."""
    server = ServerConfig(max_frame_pixels=max_frame_pixels)
    media = (
        media_bounds_or_default(processor_config, max_frame_pixels)
        if processor_config is not None
        else None
    )
    admission = Admission.for_server(
        server,
        max_model_len=MAX_POSITION,
        max_position=MAX_POSITION,
        block_size=BLOCK_SIZE,
        usable_blocks=1 << 20,
        media=media,
        engine_slots=None,
        processor_config=processor_config,
    )
    config = camera_session(processor_config is not None)
    admitted = admission.admit(config, instructions_tokens=opening_tokens)
    fp = admitted.footprint
    return Reservation(blocks=fp.blocks, tokens=fp.tokens, bounded=admitted.bounded)


def _start_checks(family: str, layout: Path | None) -> str:
    """The start-up steps that refused published checkpoints before #47, offline: the
    template splits into turns, and the processor config gives media caps."""
    try:
        compare_prompt(family, None)
    except ChatFormatError as exc:
        return f"no: {exc}"
    if layout is not None and media_bounds(read_processor_config(str(layout))) is None:
        return "no: no media caps in the processor config"
    return f"yes ({SERVED_BY[family]})"


def table_rows() -> list[list[str]]:
    rows = []
    for family in (*FAMILIES, "smollm2"):
        text = family == "smollm2"
        layout = None if text else PUBLISHED / family
        prompts = [compare_prompt(family, i) for i in (None, "Describe each frame.")]
        tok = tokenizer("smollm2-135m-instruct" if text else FAMILIES[family][0])
        system = prompts[0].chat.opening(PAGE_INSTRUCTIONS)
        opening = len(tok.encode(system, add_special_tokens=False))
        if text:
            tiny = published = camera_reservation(None, None, opening_tokens=opening)
            before = published
        else:
            assert layout is not None
            tiny_name = FAMILIES[family][0]
            tiny_config = read_processor_config(str(build_model(tiny_name)))
            registered = registered_chat_format(str(build_model(tiny_name)))
            assert registered is not None
            own = len(tok.encode(registered.opening(PAGE_INSTRUCTIONS), add_special_tokens=False))
            tiny = camera_reservation(tiny_config, DEFAULT_MAX_FRAME_PIXELS, opening_tokens=own)
            config = read_processor_config(str(layout))
            before = camera_reservation(config, None, opening_tokens=opening)
            published = camera_reservation(config, DEFAULT_MAX_FRAME_PIXELS, opening_tokens=opening)
        rows.append(
            [
                NAMES[family],
                _start_checks(family, layout),
                _blocks(tiny),
                _blocks(before),
                _blocks(published),
                " / ".join("yes" if p.equal else "no" for p in prompts),
            ]
        )
    return rows


def _blocks(r: Reservation) -> str:
    return f"{r.blocks} ({r.tokens} tokens)" if r.bounded else f"{r.blocks}, whole context"


HEADER = [
    "family",
    "starts? (served by)",
    "tiny config: blocks",
    "published, no cap (before #47)",
    "published, default cap",
    "prompt = template's (no instructions / instructions)",
]


def table() -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table())
