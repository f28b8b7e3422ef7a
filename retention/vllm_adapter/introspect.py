"""Read-only engine utilities the server, tests and benchmarks call from the front end.

vLLM 0.32's EngineCore dispatches a UTILITY request by method name (`getattr(self, name)`), and a
worker answers `collective_rpc` the same way, so a method added to the class here, in the engine
process, is callable from the front end. They only read scheduler and worker state.

What an engine carries (plugin.py decides, from the engine's settings):
- always: `kv_stats`, which the server calls (`realtime/engine_session.py:kv_pool`);
- with introspection (`settings.INTROSPECTION`, which tests and benchmarks set): also
  `retention_state` and `scheduler_state` (EngineCore), `worker_stats` (workers) and the memory diagnostics
  (`diagnostics.py`). A `serve` engine refuses them: vLLM answers an unknown method with an error.
"""

from __future__ import annotations

from typing import Any

from retention.vllm_adapter.rss import _rss_bytes, _rss_split

KV_STATS_METHOD = "vllm_realtime_kv_stats"


def _external_id(internal_id: str) -> str:
    # Internal ids are "<external id>-<8 random chars>" (InputProcessor.assign_request_id).
    return internal_id.rsplit("-", 1)[0]


def _blocks_held(blocks: Any) -> int:
    return sum(1 for b in blocks if not b.is_null)


def _find_request(scheduler: Any, external_id: str) -> tuple[str, Any] | None:
    """(internal id, Request) of the scheduler's request for this external id, if any."""
    for internal_id, request in scheduler.requests.items():
        if _external_id(internal_id) == external_id:
            return internal_id, request
    return None


def _kv_stats(core: Any) -> dict[str, Any]:
    scheduler = core.scheduler
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    managers = kv.coordinator.single_type_managers
    per_request: dict[str, int] = {}
    for manager in managers:
        for internal_id, blocks in manager.req_to_blocks.items():
            external = _external_id(internal_id)
            per_request[external] = per_request.get(external, 0) + _blocks_held(blocks)
    encoder = getattr(scheduler, "encoder_cache_manager", None)
    return {
        "num_free_blocks": int(pool.get_num_free_blocks()),
        # Block 0 is the null block, never handed out.
        "num_usable_blocks": int(pool.num_gpu_blocks - 1),
        "block_size": int(managers[0].block_size) if managers else None,
        "num_kv_cache_groups": len(managers),
        "prefix_caching": bool(kv.enable_caching),
        "num_requests": len(scheduler.requests),
        "blocks_by_request": per_request,
        # Scheduler-side encoder-cache entries (referenced or lazily freeable).
        "encoder_cache_entries": None if encoder is None else len(encoder.cached),
        "rss_bytes": _rss_bytes(),
    }


WORKER_STATS_METHOD = "vllm_realtime_worker_stats"


def _worker_stats(worker: Any) -> dict[str, Any]:
    runner = worker.model_runner
    v2_stats = getattr(runner, "realtime_worker_stats", None)
    if v2_stats is not None:
        # Our V2 runner (retention/vllm_adapter/v2/worker.py) keeps no V1 request states.
        stats: dict[str, Any] = v2_stats()
        return {
            "rss_bytes": _rss_bytes(),
            "rss_split_bytes": _rss_split(),
            "model_runner": f"V2 ({type(runner).__name__})",
            **stats,
        }
    mrope_columns = {
        _external_id(req_id): int(state.mrope_positions.shape[1])
        for req_id, state in runner.requests.items()
        if getattr(state, "mrope_positions", None) is not None
    }
    # The largest position the tensor holds, and where decode tokens continue (index + delta):
    # what a session's position bound must stay above.
    mrope_top = {
        _external_id(req_id): max(
            int(state.mrope_positions.max()) + 1 if state.mrope_positions.numel() else 0,
            int(state.num_computed_tokens) + int(state.mrope_position_delta or 0),
        )
        for req_id, state in runner.requests.items()
        if getattr(state, "mrope_positions", None) is not None
    }
    return {
        "rss_bytes": _rss_bytes(),
        "rss_split_bytes": _rss_split(),
        "model_runner": f"V1 ({type(runner).__name__})",
        "encoder_cache_entries": len(runner.encoder_cache),
        "num_requests": len(runner.requests),
        "mrope_columns_by_request": mrope_columns,
        "mrope_top_by_request": mrope_top,
    }


def _patch_worker_base(module: Any) -> None:
    if not hasattr(module.WorkerBase, WORKER_STATS_METHOD):
        setattr(module.WorkerBase, WORKER_STATS_METHOD, _worker_stats)


async def worker_stats(engine: Any) -> list[dict[str, Any]]:
    """From the front end: per worker, its RSS, encoder-cache tensors and mRoPE state."""
    result: list[dict[str, Any]] = await engine.collective_rpc(WORKER_STATS_METHOD)
    return result


def install_engine_core_utilities() -> None:
    """Idempotently add the utility production calls (`kv_stats`) to EngineCore."""
    from vllm.v1.engine.core import EngineCore

    if not hasattr(EngineCore, KV_STATS_METHOD):
        setattr(EngineCore, KV_STATS_METHOD, _kv_stats)


async def kv_stats(engine: Any) -> dict[str, Any]:
    """From the front end: the EngineCore's KV pool and per-session block counts."""
    result: dict[str, Any] = await engine.engine_core.call_utility_async(KV_STATS_METHOD)
    return result


RETENTION_STATE_METHOD = "vllm_realtime_retention_state"


def _retention_state(core: Any, external_id: str) -> dict[str, Any] | None:
    scheduler = core.scheduler
    retention = getattr(scheduler, "retention", None)
    if retention is None:
        return None
    found = _find_request(scheduler, external_id)
    if found is None or not retention.is_retention_session(found[0]):
        return None
    state: dict[str, Any] = retention.describe(found[1])
    return state


async def retention_state(engine: Any, external_id: str) -> dict[str, Any] | None:
    """From the front end: the retention bookkeeping of one session (None if it has none)."""
    result: dict[str, Any] | None = await engine.engine_core.call_utility_async(
        RETENTION_STATE_METHOD, external_id
    )
    return result


SCHEDULER_STATE_METHOD = "vllm_realtime_scheduler_state"


def _scheduler_state(core: Any) -> dict[str, Any]:
    retention = core.scheduler.retention
    return {
        "bounded_sessions": len(retention.sessions),
        # Bound at the first bounded session of an mRoPE model, never before.
        "mrope_position_function": retention.position_function is not None,
    }


async def scheduler_state(engine: Any) -> dict[str, Any]:
    """From the front end: the scheduler's engine-wide retention state."""
    result: dict[str, Any] = await engine.engine_core.call_utility_async(SCHEDULER_STATE_METHOD)
    return result


def install_introspection() -> None:
    """Idempotently add the test and benchmark utilities: `retention_state` and
    `scheduler_state` to EngineCore,
    `worker_stats` to the workers (reached by collective_rpc), the memory diagnostics to both."""
    from vllm.v1.engine.core import EngineCore

    from retention.vllm_adapter.diagnostics import install_diagnostics
    from retention.vllm_adapter.import_hooks import patch_on_import

    for name, utility in (
        (RETENTION_STATE_METHOD, _retention_state),
        (SCHEDULER_STATE_METHOD, _scheduler_state),
    ):
        if not hasattr(EngineCore, name):
            setattr(EngineCore, name, utility)
    patch_on_import("vllm.v1.worker.worker_base", _patch_worker_base)
    install_diagnostics()
