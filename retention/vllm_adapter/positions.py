"""Worker-side RoPE position offset for 1D-RoPE retention sessions (vLLM 0.32 model runner).

Theory of operation: after in-place eviction the KV cache of a session is compacted — the token
at cache index i is no longer the token at RoPE position i. Survivors keep their original
positions (their cached K was rotated at those), so a token computed now must be rotated at
`cache index + cumulative evicted width`. vLLM computes one `positions` tensor per step
(`num_computed_tokens + query_pos`) and uses it twice: for the KV slot mapping (cache index:
must stay as is) and for RoPE. We therefore add the per-request offset right AFTER the slot
mapping is computed from it, so slots use cache indices and RoPE uses true positions.

The offset travels in `SamplingParams.extra_args[POSITION_OFFSET_KEY]`, which the scheduler sets
at each chunk fold; vLLM sends a streaming continuation to the worker as a new request with its
sampling params, so the worker always sees the current value. Requests without the key (every
request that did not ask for retention) add nothing. mRoPE models use their own position tensor
(handled separately) and are left untouched here.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from retention.vllm_adapter.import_hooks import patch_on_import

POSITION_OFFSET_KEY = "vllm_realtime_position_offset"
_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"
_BLOCK_TABLE_MODULE = "vllm.v1.worker.block_table"
_PATCHED = "_vllm_realtime_positions_patched"


def request_offset(sampling_params: Any) -> int:
    extra = getattr(sampling_params, "extra_args", None)
    if not extra:
        return 0
    return int(extra.get(POSITION_OFFSET_KEY, 0))


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
                request_offset(self.requests[rid].sampling_params) if rid in self.requests else 0
                for rid in self.input_batch.req_ids
            ]
            if any(offsets):
                table._vllm_realtime_offsets = offsets
        try:
            return original_prepare(self, scheduler_output, *args, **kwargs)
        finally:
            table._vllm_realtime_offsets = None

    runner_cls._prepare_inputs = _prepare_inputs
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
