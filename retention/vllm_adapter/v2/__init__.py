"""Bounded sessions on vLLM's V2 model runner: what the front end and the scheduler need.

The runner's hooks are in ``worker.py`` (a subclass of the V2 runner, built by our worker, no
patches; its docstring has the order of the parts). This module imports no vLLM worker code:
``realtime/engine.py`` names the worker from it, and the scheduler asks it whether a V2 engine's
sessions can be bounded.
"""

from __future__ import annotations

from typing import Any, Final

CPU_WORKER_CLS: Final = "retention.vllm_adapter.v2.worker.RealtimeCPUWorker"
GPU_WORKER_CLS: Final = "retention.vllm_adapter.v2.worker.RealtimeGPUWorker"
WORKER_CLASSES: Final = (CPU_WORKER_CLS, GPU_WORKER_CLS)


def worker_cls_for(cuda: bool) -> str:
    """The ``worker_cls`` engine argument that builds our V2 runner on this platform."""
    return GPU_WORKER_CLS if cuda else CPU_WORKER_CLS


def v2_retention_refusal(vllm_config: Any) -> str | None:
    """Scheduler side: why bounded sessions of this V2 engine cannot be served (None: they can)."""
    worker_cls = str(vllm_config.parallel_config.worker_cls)
    if worker_cls not in WORKER_CLASSES:
        return (
            f"the V2 model runner built by worker {worker_cls!r}, which carries no retention "
            "hooks (vllm-realtime serve selects its own worker for V2)"
        )
    return None
