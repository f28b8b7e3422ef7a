"""Shared output helpers of the benchmarks (bench/report.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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


def test_cpu_lists_parse_and_pinning_the_front_end_to_its_own_cpus_is_a_no_op() -> None:
    """bench.tail_latency --pin-front: the CPU list syntax vLLM's binding uses, and the pin
    reaches every thread of this process (here onto the CPUs it already has)."""
    import os
    import threading

    from bench.tail_latency import parse_cpus, pin_front

    assert parse_cpus("0") == {0}
    assert parse_cpus("0,2-3") == {0, 2, 3}
    mine = os.sched_getaffinity(0)
    stop = threading.Event()
    extra = threading.Thread(target=stop.wait)
    extra.start()
    try:
        pin_front(set(mine))
        assert os.sched_getaffinity(extra.native_id or 0) == mine
    finally:
        stop.set()
        extra.join()
