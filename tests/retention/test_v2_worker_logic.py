"""The V2 runner hooks' bookkeeping (retention/vllm_adapter/v2/worker.py) over a stand-in for
vLLM's runner: which requests get an offset, the fold and resume checks, what is forgotten.
No engine: the hooks' methods call the stand-in's (vLLM's, in an engine) first, as they do
there. The same hooks on the real V2 runner: the tests marked `v2` (`make test-v2`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from retention.vllm_adapter.fold_control import FOLD_CONTROL_KEY, FoldControl, FoldControlError
from retention.vllm_adapter.v2.worker import RetentionRunnerMixin


class _StockRunner:
    """What the hooks read of vLLM's V2 runner: request slots, no RopeState."""

    def __init__(self) -> None:
        self.req_states = SimpleNamespace(req_id_to_index={}, num_computed_tokens_np=np.zeros(8))
        self.model_state = SimpleNamespace(rope_state=None)
        self.calls: list[str] = []

    def finish_requests(self, scheduler_output: Any) -> None:
        self.calls.append("finish")
        for rid in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            self.req_states.req_id_to_index.pop(rid, None)

    def add_requests(self, scheduler_output: Any) -> None:
        self.calls.append("add")
        for new in scheduler_output.scheduled_new_reqs:
            self.req_states.req_id_to_index[new.req_id] = len(self.req_states.req_id_to_index)

    def prepare_attn(self, input_batch: Any) -> str:
        self.calls.append("attn")
        return "slots"


class _Runner(RetentionRunnerMixin, _StockRunner):
    pass


def _params(control: FoldControl | None) -> Any:
    return SimpleNamespace(
        extra_args=None if control is None else {FOLD_CONTROL_KEY: control.to_args()}
    )


def _new(req_id: str, control: FoldControl | None) -> Any:
    return SimpleNamespace(req_id=req_id, sampling_params=_params(control), block_ids=([1],))


def _step(
    runner: _Runner, new: list[Any], finished: tuple[str, ...] = (), preempted: tuple[str, ...] = ()
) -> None:
    out = SimpleNamespace(
        scheduled_new_reqs=new, finished_req_ids=set(finished), preempted_req_ids=set(preempted)
    )
    runner.finish_requests(out)
    runner.add_requests(out)


def _positions(runner: _Runner, req_ids: list[str], counts: list[int]) -> list[int]:
    n = sum(counts)
    batch = SimpleNamespace(
        req_ids=req_ids,
        num_reqs=len(req_ids),
        num_scheduled_tokens=np.array(counts, dtype=np.int32),
        positions=torch.arange(n + 2, dtype=torch.int64),  # 2 padding slots
    )
    assert runner.prepare_attn(batch) == "slots"
    return list(batch.positions.tolist())


def test_only_a_sessions_tokens_move_by_its_offset_after_the_slot_mapping() -> None:
    runner = _Runner()
    _step(runner, [_new("s", FoldControl(fold=0, reset=True)), _new("plain", None)])
    assert _positions(runner, ["s", "plain"], [2, 3]) == [0, 1, 2, 3, 4, 5, 6]
    _step(runner, [_new("s", FoldControl(fold=1, position_offset=40, held_before=50))])
    # vLLM's slot mapping ran first (on the cache indices); then the session's 2 tokens moved.
    runner.calls.clear()
    assert _positions(runner, ["plain", "s"], [3, 2]) == [0, 1, 2, 43, 44, 5, 6]
    assert runner.calls == ["attn"]
    # Read by the client's id: vLLM's internal ids carry a suffix.
    _step(runner, [_new("t-abcdefgh", FoldControl(fold=0, reset=True))])
    assert runner.realtime_session_view("t") == {"position_offset": 0, "folds": [0], "resumes": 0}


def test_folds_must_follow_each_other_and_a_finished_session_is_forgotten() -> None:
    runner = _Runner()
    with pytest.raises(FoldControlError, match="expected 0 \\(a reset\\)"):
        _step(runner, [_new("s", FoldControl(fold=0))])
    runner = _Runner()
    _step(runner, [_new("s", FoldControl(fold=0, reset=True))])
    with pytest.raises(FoldControlError, match="fold 2 received, expected 1"):
        _step(runner, [_new("s", FoldControl(fold=2))])
    _step(runner, [], finished=("s",))
    assert runner._realtime_state() == {}
    # A new session under the same id starts from a reset again.
    _step(runner, [_new("s", FoldControl(fold=0, reset=True))])


def test_a_preempted_session_resumes_at_offset_zero_and_the_next_fold_counts_it() -> None:
    runner = _Runner()
    _step(runner, [_new("s", FoldControl(fold=0, reset=True))])
    _step(runner, [_new("s", FoldControl(fold=1, position_offset=30, held_before=40))])
    _step(runner, [], preempted=("s",))
    assert "s" in runner._realtime_state()  # kept across the preemption
    # It comes back as a new request with the last fold's record, offset reset by the scheduler.
    _step(runner, [_new("s", FoldControl(fold=1, held_before=40))])
    assert _positions(runner, ["s"], [3]) == [0, 1, 2, 3, 4]
    with pytest.raises(FoldControlError, match="preempted it 0 times, the worker saw 1"):
        _step(runner, [_new("s", FoldControl(fold=2, held_before=40))])


def test_a_resume_that_keeps_an_offset_is_refused() -> None:
    runner = _Runner()
    _step(runner, [_new("s", FoldControl(fold=0, reset=True))])
    _step(runner, [_new("s", FoldControl(fold=1, position_offset=30, held_before=40))])
    _step(runner, [], preempted=("s",))
    with pytest.raises(FoldControlError, match="resumed with position offset 30"):
        _step(runner, [_new("s", FoldControl(fold=1, position_offset=30, held_before=40))])


def test_a_v2_engine_bounds_sessions_only_with_our_worker() -> None:
    from retention.vllm_adapter.v2 import CPU_WORKER_CLS, GPU_WORKER_CLS, v2_retention_refusal

    def config(worker_cls: str) -> Any:
        return SimpleNamespace(parallel_config=SimpleNamespace(worker_cls=worker_cls))

    assert v2_retention_refusal(config(CPU_WORKER_CLS)) is None
    assert v2_retention_refusal(config(GPU_WORKER_CLS)) is None
    refusal = v2_retention_refusal(config("vllm.v1.worker.cpu_worker.CPUWorker"))
    assert refusal is not None and "carries no retention hooks" in refusal
