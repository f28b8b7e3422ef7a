"""Worker half of "a preempted bounded session resumes as a consolidation" (vLLM 0.32 runner).

When vLLM preempts a request it frees its blocks and later resumes it by recomputing every token
from 0. The scheduler side (``eviction.SessionRetention.on_preempted``) renumbers the session's
history 0..n-1 and rebuilds its hash chain; the worker must then rotate every recomputed token
at its cache index: position offset 0 (1D RoPE) and positions computed over the whole prompt
as for a fresh request (mRoPE).

A resumed request reaches the worker as ``CachedRequestData`` with its id in
``resumed_req_ids`` and no sampling params: the worker keeps its own copy of them, which still
carries the offset of the last fold. So the rule is applied here, to every resumed request
whose params carry a fold control record (set for every retention session at its first chunk,
``fold_control.py``), before vLLM's ``_update_states`` puts it back into the batch. The record of
the next fold carries the scheduler's preemption count, checked against the resumes counted
here. Requests without the record are untouched.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Final

from retention.vllm_adapter.fold_control import note_resume, with_offset_reset
from retention.vllm_adapter.import_hooks import patch_on_import
from retention.vllm_adapter.mrope import reset_after_preemption

_RUNNER_MODULE: Final = "vllm.v1.worker.gpu_model_runner"
_PATCHED: Final = "_vllm_realtime_preemption_patched"


def _reset_resumed(runner: Any, scheduler_output: Any) -> None:
    for req_id in scheduler_output.scheduled_cached_reqs.resumed_req_ids:
        req_state = runner.requests.get(req_id)
        if req_state is None:
            continue
        # A new extra_args dict: in a uniprocess executor these params are the scheduler's own
        # object, which on_preempted already set to the same value.
        if not with_offset_reset(req_state.sampling_params):
            continue
        if runner.uses_mrope:
            reset_after_preemption(runner, req_state)
        else:
            note_resume(req_state)


def _patch_runner(module: ModuleType) -> None:
    runner_cls = module.GPUModelRunner
    if getattr(runner_cls, _PATCHED, False):
        return
    original = runner_cls._update_states

    def _update_states(self: Any, scheduler_output: Any) -> Any:
        if scheduler_output.scheduled_cached_reqs.resumed_req_ids:
            _reset_resumed(self, scheduler_output)
        return original(self, scheduler_output)

    runner_cls._update_states = _update_states
    setattr(runner_cls, _PATCHED, True)


def install_preemption_hooks() -> None:
    """Idempotent: patch now if the model runner is loaded, else right after it loads."""
    patch_on_import(_RUNNER_MODULE, _patch_runner)
