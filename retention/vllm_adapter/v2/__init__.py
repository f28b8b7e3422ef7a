"""Bounded sessions on vLLM's V2 model runner: what the front end and the scheduler need.

The runner's hooks are in ``worker.py`` (a subclass of the V2 runner, built by our worker, no
patches; its docstring has the order of the parts). This module imports no vLLM worker code
but where it must name the class vLLM's CPU worker builds (``standalone_cpu_runner_class``):
``realtime/engine.py`` names the worker from it, and the scheduler asks it whether a V2
engine's sessions can be bounded.
"""

from __future__ import annotations

from typing import Any, Final

CPU_WORKER_CLS: Final = "retention.vllm_adapter.v2.worker.RealtimeCPUWorker"
GPU_WORKER_CLS: Final = "retention.vllm_adapter.v2.worker.RealtimeGPUWorker"
WORKER_CLASSES: Final = (CPU_WORKER_CLS, GPU_WORKER_CLS)

V2_RUNNER_BASE: Final = ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner")
"""The V2 runner class our worker subclasses: (module, name). Matched by name along a runner
class's MRO, so that asking does not import the V2 runner (its module needs Triton)."""


def worker_cls_for(cuda: bool) -> str:
    """The ``worker_cls`` engine argument that builds our V2 runner on this platform."""
    return GPU_WORKER_CLS if cuda else CPU_WORKER_CLS


def is_v2_runner_class(runner_cls: type[Any]) -> bool:
    """Whether ``runner_cls`` derives from vLLM's V2 ``GPUModelRunner`` (ours can wrap it)."""
    return any((c.__module__, c.__qualname__) == V2_RUNNER_BASE for c in runner_cls.__mro__)


def runner_class_refusal(runner_cls: type[Any]) -> str | None:
    """Why sessions cannot be bounded on a worker whose runner is ``runner_cls`` (None: they
    can). Our worker builds its hooks as a subclass of the V2 runner; a runner not derived from
    it (vLLM 0.34's ``StandaloneCPUModelRunner``) keeps none of them, and a session on it
    would run unbounded in the cache, with positions and eviction out of step."""
    if is_v2_runner_class(runner_cls):
        return None
    module, name = V2_RUNNER_BASE
    return (
        f"vLLM's CPU worker builds {runner_cls.__module__}.{runner_cls.__qualname__} on this "
        f"platform, a model runner not derived from the V2 runner ({module}.{name}), which "
        "vllm-realtime's worker cannot add the retention hooks to"
    )


def standalone_cpu_runner_class() -> type[Any] | None:
    """The runner class vLLM's CPU worker builds here when it is not the V2-based
    ``CPUModelRunner``: vLLM 0.34's ``StandaloneCPUModelRunner``, which its ``CPUWorker.
    init_device`` builds where ``current_platform.uses_standalone_cpu_model_runner()`` (a
    non-x86 CPU without Triton). None elsewhere, and on 0.32/0.33 (no standalone runner)."""
    from vllm.platforms import current_platform

    uses_standalone = getattr(current_platform, "uses_standalone_cpu_model_runner", None)
    if not current_platform.is_cpu() or uses_standalone is None or not uses_standalone():
        return None
    from vllm.v1.worker.cpu.standalone_model_runner import StandaloneCPUModelRunner

    runner_cls: type[Any] = StandaloneCPUModelRunner
    return runner_cls


def v2_retention_refusal(vllm_config: Any, runner_cls: type[Any] | None = None) -> str | None:
    """Scheduler side: why bounded sessions of this V2 engine cannot be served (None: they can).
    ``runner_cls``: the runner class the CPU worker builds where it is not V2-based (found on
    this platform when None: ``standalone_cpu_runner_class``)."""
    worker_cls = str(vllm_config.parallel_config.worker_cls)
    if worker_cls not in WORKER_CLASSES:
        return (
            f"the V2 model runner built by worker {worker_cls!r}, which carries no retention "
            "hooks (vllm-realtime serve selects its own worker for V2)"
        )
    if runner_cls is None:
        runner_cls = standalone_cpu_runner_class()
    if runner_cls is not None:
        return runner_class_refusal(runner_cls)
    return None
