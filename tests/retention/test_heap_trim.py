"""The worker's heap trim after a consolidation is rate-limited per process."""

from __future__ import annotations

import pytest

from retention.vllm_adapter import heap_trim


def test_trim_runs_at_most_once_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(heap_trim, "_STATE", {"trim": calls.append})
    assert heap_trim.trim_free_heap(now=100.0)
    assert not heap_trim.trim_free_heap(now=100.0 + heap_trim.MIN_INTERVAL_S / 2)
    assert heap_trim.trim_free_heap(now=100.0 + heap_trim.MIN_INTERVAL_S)
    assert calls == [0, 0]


def test_without_glibc_nothing_is_trimmed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap_trim, "_STATE", {"trim": None})
    assert not heap_trim.trim_free_heap(now=1e9)
