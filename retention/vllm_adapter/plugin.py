"""vLLM general plugin: the engine hooks, installed only in engines vllm-realtime started.

vLLM calls `register()` (entry point group `vllm.general_plugins`) once in every process of every
vLLM in the environment: in a front end when it builds its engine arguments, before any config
exists, and in EngineCore and each worker at start-up, once the engine's `VllmConfig` exists.
So the plugin first finds the config of the engine being started (`engine_config_being_started`)
and returns at once unless it carries our settings (`settings.REALTIME_CONFIG_KEY` in
`additional_config`, which only `realtime/engine.py` writes). A plain vLLM engine, a front end,
and any other process are left exactly as vLLM made them.

In our EngineCore and workers it checks the vLLM version first, so that a mismatched install
fails loudly before any hook patches internals it does not know; then installs what production
uses, and the test and benchmark utilities only when the engine's settings ask for introspection
(`settings.INTROSPECTION`). The V1 worker hooks patch the V1 GPU model runner and are installed
only in an engine that runs it (the capability record's `runner_of`, capabilities.py): a V2
engine's hooks are its worker's runner subclass (v2/), and its processes carry none of the V1
patches, even on 0.32, where the V1 runner's module is there. Where the hooks of the engine's
runner are not executed on this vLLM the scheduler refuses to start, with the reason
(`check_serving_support`), so no session runs without them.

Our front end installs its own half (`install_front_end_hooks`) from `realtime/engine.py`, in the
process that starts the engine, not through this entry point. An engine run inside its front
end's process (`vllm.LLM` with VLLM_ENABLE_V1_MULTIPROCESSING=0) would get no hooks: vLLM loads
the plugins there once, from the front end, before any config exists. `start_engine` starts
`AsyncLLM`, whose EngineCore always runs in a process of its own.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any, Final

from retention.vllm_adapter.settings import introspection_requested, realtime_settings

_registered = False

_CONFIG_SEARCH_DEPTH: Final = 8
"""Frames above `register` searched for the config: vLLM 0.32-0.34 call the plugins from
`load_general_plugins`, called straight from `EngineCore.__init__(vllm_config, ...)` and
`WorkerWrapperBase.init_worker` (whose local `vllm_config` is set just before), i.e. 2 frames up."""


def engine_config_being_started() -> Any | None:
    """The `VllmConfig` of the engine this process is starting, or None (a front end, or any
    other caller).

    vLLM passes its plugins no argument, and its current-config context is not entered yet when
    they run; but both places that load them in an engine process hold the config in a local
    named `vllm_config` (vllm/v1/engine/core.py `EngineCore.__init__`, vllm/v1/worker/
    worker_base.py `WorkerWrapperBase.init_worker`; the same in the 0.33 and 0.34 sources). Read
    there, nothing is patched to learn it. tests/retention/test_plugin_scope.py fails if a vLLM
    release moves it: our engines would then lack their hooks.
    """
    try:
        from vllm.config import VllmConfig
    except ImportError:
        return None
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_CONFIG_SEARCH_DEPTH):
        if frame is None:
            return None
        candidate = frame.f_locals.get("vllm_config")
        if isinstance(candidate, VllmConfig):
            return candidate
        frame = frame.f_back
    return None


def register() -> None:
    """vLLM's entry point: a no-op unless the engine being started is one of ours."""
    global _registered
    if _registered:
        return
    vllm_config = engine_config_being_started()
    settings = realtime_settings(vllm_config)
    if settings is None:
        return
    install_engine_process_hooks(
        introspection=introspection_requested(settings), vllm_config=vllm_config
    )
    _registered = True


def install_engine_process_hooks(introspection: bool, vllm_config: Any = None) -> None:
    """Everything our EngineCore and worker processes need; with `introspection`, also the
    utilities only tests and benchmarks call; the V1 worker hooks only where `vllm_config`'s
    engine runs the V1 runner (None: wherever vLLM has it). Idempotent."""
    from retention.vllm_adapter import check_vllm_version
    from retention.vllm_adapter.capabilities import vllm_capabilities

    check_vllm_version()
    from retention.vllm_adapter.lifecycle import install_parent_death_watch

    # EngineCore and workers exit when the server dies, even by SIGKILL (lifecycle.py).
    install_parent_death_watch()
    from retention.vllm_adapter.introspect import install_engine_core_utilities

    # kv_stats: the server reads the KV pool's geometry from it (realtime/engine_session.py).
    install_engine_core_utilities()
    from retention.vllm_adapter.shm_prefault import install_shm_prefault

    # vLLM's shared-memory step rings resident from start-up, so their pages are not a slope.
    install_shm_prefault()
    from retention.vllm_adapter.quiet_load import install_quiet_weight_loading

    # One "Downcasting" line for a float32 model served in bf16, not a warning per weight.
    install_quiet_weight_loading()
    from retention.vllm_adapter.quiet_start import install_quiet_start

    # No warnings for serve's deliberate choices (eager, no Triton, our scheduler, ...).
    install_quiet_start()
    if introspection:
        from retention.vllm_adapter.introspect import install_introspection

        # retention_state, scheduler_state, worker_stats, heap_stats (with trim_read): tests
        # and bench only.
        install_introspection()
    capabilities = vllm_capabilities()
    if vllm_config is None:
        v1_engine = capabilities.v1_model_runner
    else:
        v1_engine = capabilities.runner_of(vllm_config) == "v1"
    if v1_engine:
        _install_worker_hooks()


def install_front_end_hooks() -> None:
    """The front-end half, in the process that starts one of our engines (`start_engine`).
    These patch vLLM's front-end classes in this process only. Idempotent."""
    from retention.vllm_adapter import check_vllm_version

    check_vllm_version()
    from retention.vllm_adapter.streaming import install_streaming_hardening

    # Front-end half of the streaming-input hardening (the EngineCore half is the scheduler,
    # selected in realtime/engine.py).
    install_streaming_hardening()
    from retention.vllm_adapter.lifecycle import install_idempotent_shutdown

    # No AsyncLLM.__del__ traceback at exit: a shut-down engine is not shut down again.
    install_idempotent_shutdown()
    from retention.vllm_adapter.quiet_start import install_quiet_start

    # No warnings for serve's deliberate choices (eager, no Triton, our scheduler).
    install_quiet_start()


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
