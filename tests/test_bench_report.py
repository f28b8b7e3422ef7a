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
