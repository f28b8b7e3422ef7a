"""Read-only EngineCore utilities the server and tests call through `call_utility_async`.

vLLM 0.32's EngineCore dispatches a UTILITY request by method name (`getattr(self, name)`), so a
method added to the class here, in the EngineCore process, is callable from the front end. They
only read scheduler state.
"""

from __future__ import annotations

from typing import Any

KV_STATS_METHOD = "vllm_realtime_kv_stats"


def _kv_stats(core: Any) -> dict[str, Any]:
    scheduler = core.scheduler
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    managers = kv.coordinator.single_type_managers
    per_request: dict[str, int] = {}
    for manager in managers:
        for internal_id, blocks in manager.req_to_blocks.items():
            # Internal ids are "<external id>-<8 random chars>" (InputProcessor.assign_request_id).
            external = internal_id.rsplit("-", 1)[0]
            held = sum(1 for b in blocks if not b.is_null)
            per_request[external] = per_request.get(external, 0) + held
    return {
        "num_free_blocks": int(pool.get_num_free_blocks()),
        # Block 0 is the null block, never handed out.
        "num_usable_blocks": int(pool.num_gpu_blocks - 1),
        "block_size": int(managers[0].block_size) if managers else None,
        "num_kv_cache_groups": len(managers),
        "num_requests": len(scheduler.requests),
        "blocks_by_request": per_request,
    }


def install_engine_core_utilities() -> None:
    """Idempotently add our utility methods to EngineCore (only in processes that import it)."""
    from vllm.v1.engine.core import EngineCore

    if not hasattr(EngineCore, KV_STATS_METHOD):
        setattr(EngineCore, KV_STATS_METHOD, _kv_stats)


async def kv_stats(engine: Any) -> dict[str, Any]:
    """From the front end: the EngineCore's KV pool and per-session block counts."""
    result: dict[str, Any] = await engine.engine_core.call_utility_async(KV_STATS_METHOD)
    return result
