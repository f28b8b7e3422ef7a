"""vllm-realtime's settings, carried to every vLLM process inside the engine's own config.

vLLM hands `VllmConfig.additional_config` (a dict) to EngineCore and to every worker. Our settings
live there under one key, so a `serve` flag reaches the scheduler and the worker hooks without an
environment variable, and an engine that someone else started carries none of them. The key's
presence is also what marks an engine as ours: the plugin (`plugin.py`) installs nothing in an
engine whose config lacks it.
"""

from __future__ import annotations

from typing import Any, Final

REALTIME_CONFIG_KEY: Final = "vllm_realtime"

INTROSPECTION: Final = "introspection"
"""True: the engine also carries the test and benchmark utilities (`retention_state`,
`scheduler_state`, `worker_stats`, the memory diagnostics `heap_stats` with `trim_read`). Absent or False, as
`serve` starts it: only what production calls (`kv_stats`)."""


def realtime_settings(vllm_config: Any) -> dict[str, Any] | None:
    """Our settings in this engine's config, or None for an engine vllm-realtime did not start."""
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, dict):
        return None
    settings = extra.get(REALTIME_CONFIG_KEY)
    return settings if isinstance(settings, dict) else None


def introspection_requested(settings: dict[str, Any]) -> bool:
    return bool(settings.get(INTROSPECTION, False))


CONSOLIDATION_KEY: Final = "consolidation"
"""The engine's consolidation mode for a budget that names none ("rotate", "reprefill");
`serve --consolidation`. Absent: `eviction.DEFAULT_CONSOLIDATION`."""

REPREFILL_PIECE_KEY: Final = "reprefill_piece"
"""Tokens per step of a consolidation's re-prefill (0 or a power of two; 0: one step);
`serve --reprefill-piece`. Absent: `eviction.DEFAULT_REPREFILL_PIECE`."""
