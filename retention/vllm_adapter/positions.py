"""Worker-side RoPE position offset for 1D-RoPE retention sessions (vLLM 0.32 model runner).

Theory of operation: after in-place eviction the KV cache of a session is compacted — the token
at cache index i is no longer the token at RoPE position i. Survivors keep their original
positions (their cached K was rotated at those), so a token computed now must be rotated at
`cache index + cumulative evicted width`. vLLM computes one `positions` tensor per step
(`num_computed_tokens + query_pos`) and uses it twice: for the KV slot mapping (cache index:
must stay as is) and for RoPE. We therefore add the per-request offset right AFTER the slot
mapping is computed from it, so slots use cache indices and RoPE uses true positions.

The offset travels in the session's fold control record (`fold_control.py`), which the scheduler
sets at each chunk fold; vLLM sends a streaming continuation to the worker as a new request with
its sampling params, so the worker always sees the current value. For 1D models the worker
checks each new record once (`accept_fold`, after vLLM updated its request states); mRoPE models
check it in `mrope.py`. Requests without the record (every request that did not ask for
retention) add nothing. A consolidation by rotation (``kv_rotation.py``) is applied here too,
at the fold that carries it, before the step runs. mRoPE models use their own position tensor
(handled separately) and are left untouched here.

1D VLMs (SmolVLM/Idefics3) need nothing more: an image's tokens advance the position by one each,
like text, and its multimodal offset, encoder-input scheduling and encoder-cache entry live in
cache coordinates, which eviction compacts (``eviction.py``) apart from positions
(tests/retention/test_smolvlm_retention.py).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from retention.vllm_adapter.fold_control import accept_fold, fold_control_of, position_offset_of
from retention.vllm_adapter.heap_trim import release_after_consolidation
from retention.vllm_adapter.import_hooks import patch_on_import
from retention.vllm_adapter.kv_rotation import rotator_of

_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
_BLOCK_TABLE_MODULE = "vllm.v1.worker.block_table"
_PATCHED = "_vllm_realtime_positions_patched"


def _patch_runner(module: ModuleType) -> None:
    runner_cls = module.GPUModelRunner
    if getattr(runner_cls, _PATCHED, False):
        return
    original_prepare = runner_cls._prepare_inputs

    def _prepare_inputs(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        table = self.input_batch.block_table
        table._vllm_realtime_offsets = None
        if not self.uses_mrope:
            offsets = [
                position_offset_of(self.requests[rid].sampling_params)
                if rid in self.requests
                else 0
                for rid in self.input_batch.req_ids
            ]
            if any(offsets):
                table._vllm_realtime_offsets = offsets
        try:
            return original_prepare(self, scheduler_output, *args, **kwargs)
        finally:
            table._vllm_realtime_offsets = None

    original_update = runner_cls._update_states

    def _update_states(self: Any, scheduler_output: Any) -> Any:
        result = original_update(self, scheduler_output)
        if not self.uses_mrope:
            # A folded continuation arrives as a new request: check its record once.
            for new_req in scheduler_output.scheduled_new_reqs:
                req_state = self.requests.get(new_req.req_id)
                if req_state is None:
                    continue
                control = fold_control_of(req_state.sampling_params)
                if control is not None:
                    accept_fold(req_state, control)
                    release_after_consolidation(control)
                    if control.rotations:
                        # A consolidation by rotation: before this step computes the chunk.
                        rotator_of(self).rotate(req_state.block_ids[0], control.rotations)
        return result

    runner_cls._prepare_inputs = _prepare_inputs
    runner_cls._update_states = _update_states
    setattr(runner_cls, _PATCHED, True)


def _patch_block_table(module: ModuleType) -> None:
    table_cls = module.MultiGroupBlockTable
    if getattr(table_cls, _PATCHED, False):
        return
    original = table_cls.compute_slot_mapping

    def compute_slot_mapping(
        self: Any, num_reqs: int, query_start_loc: Any, positions: Any
    ) -> None:
        original(self, num_reqs, query_start_loc, positions)
        offsets = getattr(self, "_vllm_realtime_offsets", None)
        if offsets is None:
            return
        import torch

        counts = (query_start_loc[1 : num_reqs + 1] - query_start_loc[:num_reqs]).to("cpu")
        per_req = torch.tensor(offsets[:num_reqs], dtype=positions.dtype)
        per_token = torch.repeat_interleave(per_req, counts).to(positions.device)
        positions += per_token  # in place: this is a view of the runner's positions buffer

    table_cls.compute_slot_mapping = compute_slot_mapping
    setattr(table_cls, _PATCHED, True)


_PATCHERS = {_RUNNER_MODULE: _patch_runner, _BLOCK_TABLE_MODULE: _patch_block_table}


def install_position_offset_hooks() -> None:
    """Idempotent: patch now if the modules are loaded, else right after they load."""
    for name, patcher in _PATCHERS.items():
        patch_on_import(name, patcher)
