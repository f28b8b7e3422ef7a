"""docs/protocol.md shows what a default server sends: its limits examples, session ids and
defaults are the code's, so a reader who copies them is not misled (they drifted before)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from realtime.config import ServerConfig
from realtime.media import MAX_CLIP_FRAMES
from vllm_realtime_protocol import new_session_id

DOC = (Path(__file__).resolve().parents[2] / "docs" / "protocol.md").read_text(encoding="utf-8")
EXAMPLES = [json.loads(block) for block in re.findall(r"```json\n(.*?)```", DOC, flags=re.S)]
WITH_LIMITS = [e for e in EXAMPLES if isinstance(e.get("limits"), dict)]


def default_limits(model: str, multimodal: bool) -> dict[str, object]:
    """What SessionHub.limits() sends for a default ServerConfig and a 2,048-token context."""
    config = ServerConfig()
    return {
        "max_frame_bytes": config.max_frame_bytes,
        "max_event_bytes": 16 << 20,
        "max_sessions": config.max_sessions,
        "idle_timeout_s": config.idle_timeout_s,
        "max_tokens_cap": 1024,  # min(1024, max_model_len // 2)
        "max_resume_grace_s": config.max_resume_grace_s,
        "max_chunk_tokens": config.max_chunk_tokens,
        "max_instructions_tokens": config.max_instructions_tokens,
        "max_clip_frames": MAX_CLIP_FRAMES if multimodal else None,
        "max_frame_pixels": config.max_frame_pixels if multimodal else None,
        "server_version": "0.1.0",
        "model": model,
        "protocol_version": "2026-12-01",
    }


def test_the_doc_shows_limits() -> None:
    assert {e["type"] for e in WITH_LIMITS} >= {"session.created", "session.opened"}


@pytest.mark.parametrize("example", WITH_LIMITS, ids=lambda e: str(e["type"]))
def test_limits_examples_are_a_default_servers(example: dict[str, object]) -> None:
    limits = example["limits"]
    assert isinstance(limits, dict)
    multimodal = limits["max_clip_frames"] is not None
    assert limits == default_limits(str(limits["model"]), multimodal)


def test_session_ids_look_like_the_servers() -> None:
    shape = re.compile(r"sess_[0-9a-f]{32}")
    assert shape.fullmatch(new_session_id())
    shown = {e["session_id"] for e in EXAMPLES if "session_id" in e}
    assert shown and all(shape.fullmatch(str(s)) for s in shown), shown
    assert "128 random bits" in DOC
