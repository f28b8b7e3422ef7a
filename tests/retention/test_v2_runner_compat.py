"""What the V2 hooks (retention/vllm_adapter/v2/worker.py) rely on in vLLM's V2 runner code,
read from each supported vLLM's own modules (`make compat`: 0.33's and 0.34's code too).

No model runs here: the hooks override `finish_requests`, `add_requests` and `prepare_attn`,
call vLLM's first, and read named fields; a release that renames one of them, reorders the
calls in `execute_model`, or stops computing the slot mappings from `input_batch.positions`
fails here instead of giving wrong positions. Executing the hooks on 0.34's runner code (its
kernels under the Triton interpreter) is the next step: docs/history/v2-runner.md.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

pytestmark = pytest.mark.compat


def _params(function: object) -> list[str]:
    return list(inspect.signature(function).parameters)  # type: ignore[arg-type]


def test_our_worker_module_imports_over_this_vllm() -> None:
    from retention.vllm_adapter.v2 import CPU_WORKER_CLS, GPU_WORKER_CLS
    from retention.vllm_adapter.v2.worker import RealtimeCPUWorker, RealtimeGPUWorker

    assert CPU_WORKER_CLS.rsplit(".", 1)[1] == RealtimeCPUWorker.__name__
    assert GPU_WORKER_CLS.rsplit(".", 1)[1] == RealtimeGPUWorker.__name__
    assert callable(getattr(RealtimeGPUWorker, "_make_model_runner", None))


def test_the_runner_methods_the_hooks_override_keep_their_order_and_inputs() -> None:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    assert _params(GPUModelRunner.finish_requests) == ["self", "scheduler_output"]
    assert _params(GPUModelRunner.add_requests) == ["self", "scheduler_output"]
    assert _params(GPUModelRunner.prepare_attn) == ["self", "input_batch"]
    execute = inspect.getsource(GPUModelRunner.execute_model)
    order = [execute.index(f"self.{name}(") for name in ("finish_requests", "add_requests")]
    order.append(execute.index("self.prepare_attn(input_batch)"))
    # Positions reach the model after prepare_attn, from the buffer the offset is added to.
    order.append(execute.index('"positions": input_batch.positions'))
    assert order == sorted(order)
    assert "self.model_state.prepare_inputs(" in execute
    # The slot mappings are computed from the token-index positions, before our offset.
    attn = inspect.getsource(GPUModelRunner.prepare_attn)
    assert "compute_slot_mappings(" in attn and "input_batch.positions" in attn
    # A chunk (or a resume) is removed and added again: our record is read at every re-add.
    add = inspect.getsource(GPUModelRunner.add_requests)
    assert "self._remove_request(req_id)" in add and "model_state.add_request(" in add
    # A preempted request is removed like a finished one.
    assert "preempted_req_ids" in inspect.getsource(GPUModelRunner.finish_requests)


def test_the_fields_the_hooks_read() -> None:
    from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
    from vllm.v1.worker.gpu.input_batch import InputBatch

    new_fields = {f.name for f in dataclasses.fields(NewRequestData)}
    assert {"req_id", "sampling_params", "block_ids", "prefill_token_ids"} <= new_fields
    assert {"num_computed_tokens", "mm_features"} <= new_fields
    out_fields = {f.name for f in dataclasses.fields(SchedulerOutput)}
    assert {"scheduled_new_reqs", "finished_req_ids", "preempted_req_ids"} <= out_fields
    batch_fields = {f.name for f in dataclasses.fields(InputBatch)}
    assert {"req_ids", "num_reqs", "num_scheduled_tokens", "positions"} <= batch_fields


def test_rope_state_rows_can_be_read_and_overwritten() -> None:
    from vllm.v1.worker.gpu.mm.rope import RopeState
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    assert _params(RopeState.update_prefill_positions) == ["self", "req_idx", "positions", "delta"]
    assert _params(RopeState.read_prefill_positions) == ["self", "req_idx", "length"]
    assert "self.prefill_delta" in inspect.getsource(RopeState.__init__)
    # The model reads RopeState's positions (where the fold's rows are), not the 1D buffer.
    assert "rope_state" in inspect.getsource(DefaultModelState.prepare_inputs)
