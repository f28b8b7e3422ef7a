"""Checkpoints laid out as published ones: a family's tiny model carrying the published chat
template and processor configs (tests/published/, sources named in its README). Shared by the
engine-free checks (test_published_checkpoints.py) and the engine tests on these layouts
(test_serve_model_dir.py, retention/test_published_oracle.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

from realtime.models import build_model

PUBLISHED = Path(__file__).resolve().parent / "published"


# family -> (tiny model it is put on, template file)
FAMILIES = {
    "qwen2-vl": ("tiny-qwen2-vl", "qwen2_5_vl.jinja"),
    "qwen2.5-vl": ("tiny-qwen2.5-vl", "qwen2_5_vl.jinja"),
    "qwen3-vl": ("tiny-qwen3-vl", "qwen3_vl.jinja"),
    "smolvlm": ("tiny-smolvlm", "smolvlm.jinja"),
}


def published_checkpoint(family: str, out: Path) -> Path:
    """The family's tiny model with the published template and processor configs: a
    checkpoint laid out as a published one (the embedded model's nested processor config
    removed)."""
    tiny, template = FAMILIES[family]
    checkpoint = out / f"published-{family}"
    shutil.copytree(build_model(tiny), checkpoint)
    (checkpoint / "processor_config.json").unlink()
    for path in (PUBLISHED / family).iterdir():
        shutil.copy(path, checkpoint / path.name)
    shutil.copy(PUBLISHED / "templates" / template, checkpoint / "chat_template.jinja")
    return checkpoint


def published_smolvlm_256m(out: Path) -> Path:
    """A tiny SmolVLM with SmolVLM-256M-Instruct's vision geometry (512-px tiles, patch 16,
    scale factor 4: 64 tokens a tile), carrying its published template and processor configs
    (the tiny-smolvlm's 32-px tiles cannot take them)."""
    from realtime.models.tiny_smolvlm import build_tiny_smolvlm

    checkpoint = out / "published-smolvlm-256m"
    build_tiny_smolvlm(checkpoint, tile=512, longest_edge=2048, patch=16, scale_factor=4)
    (checkpoint / "processor_config.json").unlink()
    for path in (PUBLISHED / "smolvlm").iterdir():
        shutil.copy(path, checkpoint / path.name)
    shutil.copy(PUBLISHED / "templates" / "smolvlm.jinja", checkpoint / "chat_template.jinja")
    return checkpoint
