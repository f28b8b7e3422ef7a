"""Shared output helpers of the benchmarks (bench/report.py)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.report import emit_json, trace_summary


def test_emit_json_prints_and_writes_the_same_document(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "deep" / "run.json"
    emit_json({"bench": "x", "runs": [1, 2]}, out)
    assert json.loads(out.read_text()) == {"bench": "x", "runs": [1, 2]}
    assert json.loads(capsys.readouterr().out) == {"bench": "x", "runs": [1, 2]}


def test_trace_summary_only_when_the_worker_traced() -> None:
    assert trace_summary({"rss_bytes": 1}) is None
    top = [{"stack": ["a.py:1"], "size_diff": 144, "count_diff": 1}]
    assert trace_summary({"traced_bytes": 9, "trace_top": top}) == {"traced_bytes": 9, "top": top}


def test_pinning_the_front_end_reaches_every_thread_of_the_process() -> None:
    """bench.tail_latency --pin-front: affinity is per thread on Linux, so a pin that set only
    the main thread would leave the others where they were."""
    import os
    import threading

    from bench.tail_latency import pin_front

    mine = os.sched_getaffinity(0)
    if len(mine) < 2:
        pytest.skip("needs two CPUs to pin onto one of them")
    one = {min(mine)}
    stop = threading.Event()
    extra = threading.Thread(target=stop.wait)
    extra.start()
    try:
        pin_front(one)
        assert extra.native_id is not None
        assert os.sched_getaffinity(extra.native_id) == one
        assert os.sched_getaffinity(0) == one
    finally:
        pin_front(set(mine))
        stop.set()
        extra.join()
    assert os.sched_getaffinity(0) == mine


def test_the_uni_executor_the_latency_bench_names_is_vllms() -> None:
    """`bench.tail_latency --executors uni` names vLLM's in-process executor by its class path
    (the CPU platform rewrites the short name "uni" to "mp")."""
    from typing import get_args

    from vllm.config.parallel import DistributedExecutorBackend
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.executor.abstract import Executor

    from bench.tail_latency import EXECUTORS

    # "mp" is passed through as a backend name: it must be one vLLM accepts.
    assert EXECUTORS["mp"] in get_args(DistributedExecutorBackend)
    assert issubclass(resolve_obj_by_qualname(EXECUTORS["uni"]), Executor)


@settings(max_examples=60, deadline=None)
@given(
    capacity=st.integers(min_value=0, max_value=12),
    start=st.integers(min_value=0, max_value=25),
    flaky=st.sets(st.integers(min_value=1, max_value=12)),
)
def test_the_box_finds_the_same_true_capacity_from_wherever_admission_stopped(
    capacity: int, start: int, flaky: set[int]
) -> None:
    """bench.capacity --box's search after the admitted run: from any admitted count, up or down,
    it ends on the largest level that meets the SLO, and a level that missed once (a stall) is
    tried again before it counts as a miss."""
    import argparse

    import bench.capacity as box

    tried: list[int] = []

    async def level(url: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
        first = n in flaky and n not in tried
        tried.append(n)
        slow = n > capacity or first
        return {"sessions": n, "admitted": n, "p99_ms": 1500.0 if slow else 500.0,
                "answered_share": 1.0}  # fmt: skip

    async def no_wait(_: float) -> None:
        return None

    args = argparse.Namespace(fps=1.0, max_level=12, window=4, max_tokens=8, declare=False,
                              seconds=1.0, warmup=0.0)  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(box, "_camera_level", level)
        patch.setattr(box.asyncio, "sleep", no_wait)
        found, levels = asyncio.run(box._capacity_near("ws://unused", start, args))
    assert found == capacity
    assert len(levels) == len(tried)


def _dtype_run(dtype: str, p50: float | None) -> dict[str, Any]:
    return {"dtype": dtype, "p50_ms": p50, "p99_ms": p50, "answered_share": 1.0}


def test_the_dtype_check_says_whether_serve_chose_this_cpus_faster_dtype() -> None:
    from bench.capacity import _dtype_check_line, _dtype_verdict

    no_bf16 = {
        "cpu": {"model": "AVX2 box", "cpus": 2, "flags": ["avx2"]},
        "default": _dtype_run(
            "INFO 12-08 dtype: float32, the CPU has no native bf16 (no avx512_bf16/amx_bf16 flag)",
            620.0,
        ),
        "float32": _dtype_run("dtype: float32 (--dtype)", 600.0),
        "bfloat16": _dtype_run("dtype: bfloat16 (--dtype)", 1301.0),
    }
    no_bf16.update(_dtype_verdict(no_bf16))
    assert no_bf16["within_10_percent"] and no_bf16["serve_chose_faster"]
    assert no_bf16["faster_dtype"] == "float32"
    assert no_bf16["default_over_bfloat16_p50"] == round(620 / 1301, 3)
    line = _dtype_check_line(no_bf16)
    assert "AVX2 box" in line and "faster here: float32, serve chose it: True" in line

    wrong = {**no_bf16, "bfloat16": _dtype_run("dtype: bfloat16 (--dtype)", 400.0)}
    wrong.update(_dtype_verdict(wrong))
    assert wrong["faster_dtype"] == "bfloat16" and not wrong["serve_chose_faster"]

    unanswered = {**no_bf16, "bfloat16": _dtype_run("dtype: bfloat16 (--dtype)", None)}
    unanswered.update(_dtype_verdict(unanswered))
    assert unanswered["faster_dtype"] is None and not unanswered["serve_chose_faster"]
    assert unanswered["default_over_bfloat16_p50"] is None
