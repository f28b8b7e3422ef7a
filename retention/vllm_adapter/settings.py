"""vllm-realtime's settings, carried to every vLLM process inside the engine's own config.

vLLM hands `VllmConfig.additional_config` (a dict) to EngineCore and to every worker. Our settings
live there under one key, so a `serve` flag reaches the scheduler and the worker hooks without an
environment variable, and an engine that someone else started carries none of them.
"""

from __future__ import annotations

from typing import Any, Final

REALTIME_CONFIG_KEY: Final = "vllm_realtime"


def realtime_settings(vllm_config: Any) -> dict[str, Any] | None:
    """Our settings in this engine's config, or None for an engine vllm-realtime did not start."""
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, dict):
        return None
    settings = extra.get(REALTIME_CONFIG_KEY)
    return settings if isinstance(settings, dict) else None


CONSOLIDATION_KEY: Final = "consolidation"
"""The engine's consolidation mode for a budget that names none ("rotate", "reprefill");
`serve --consolidation`. Absent: `eviction.DEFAULT_CONSOLIDATION`."""

REPREFILL_PIECE_KEY: Final = "reprefill_piece"
"""Tokens per step of a consolidation's re-prefill (0 or a power of two; 0: one step);
`serve --reprefill-piece`. Absent: `eviction.DEFAULT_REPREFILL_PIECE`."""
