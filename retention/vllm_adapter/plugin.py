"""vLLM general plugin: runs once in every vLLM process (front end, EngineCore, workers).

Must be idempotent. It checks the vLLM version first, so that a mismatched install fails loudly in
every process before any hook patches internals it does not know; then installs the hooks. The
worker hooks patch the V1 GPU model runner and are installed only where vLLM has it (the
capability record, capabilities.py); elsewhere `BoundedSessionScheduler` refuses to start, with
the reason (`check_serving_support`), so no session runs without them.
"""

from __future__ import annotations

from retention.vllm_adapter import check_vllm_version
from retention.vllm_adapter.capabilities import vllm_capabilities

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    check_vllm_version()
    worker_hooks = vllm_capabilities().v1_model_runner
    from retention.vllm_adapter.lifecycle import install_parent_death_watch

    # EngineCore and workers exit when the server dies, even by SIGKILL (lifecycle.py).
    install_parent_death_watch()
    from retention.vllm_adapter.introspect import install_engine_core_utilities
    from retention.vllm_adapter.streaming import install_streaming_hardening

    install_engine_core_utilities()
    from retention.vllm_adapter.introspect import install_worker_utilities

    install_worker_utilities()
    from retention.vllm_adapter.shm_prefault import install_shm_prefault

    # vLLM's shared-memory step rings resident from start-up, so their pages are not a slope.
    install_shm_prefault()
    from retention.vllm_adapter.diagnostics import install_diagnostics

    # Memory diagnostics only when a benchmark asks for them (VLLM_REALTIME_DIAGNOSTICS=1).
    install_diagnostics()
    if worker_hooks:
        _install_worker_hooks()
    # Front-end half of the streaming-input hardening (the EngineCore half is
    # RetentionScheduler, selected in realtime/engine.py). It patches front-end classes, which
    # the EngineCore and worker processes import but never use.
    install_streaming_hardening()
    from retention.vllm_adapter.lifecycle import install_idempotent_shutdown

    # No AsyncLLM.__del__ traceback at exit: a shut-down engine is not shut down again.
    install_idempotent_shutdown()
    _registered = True


def _install_worker_hooks() -> None:
    """The hooks of the V1 GPU model runner (imported only where it exists)."""
    from retention.vllm_adapter.positions import install_position_offset_hooks

    # Worker half of 1D-RoPE retention: RoPE positions = cache index + per-request offset.
    install_position_offset_hooks()
    from retention.vllm_adapter.mrope import install_mrope_hooks

    # Worker half of mRoPE retention: per-request 3-D positions extended per chunk, sliced on
    # eviction (the scheduler sends what it evicted at each fold).
    install_mrope_hooks()
    from retention.vllm_adapter.preemption import install_preemption_hooks

    # Worker half of "a preempted bounded session resumes as a consolidation".
    install_preemption_hooks()
