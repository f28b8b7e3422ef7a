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


def test_rss_split_tells_anonymous_from_file_backed_pages() -> None:
    from retention.vllm_adapter.introspect import _rss_bytes, _rss_split

    split = _rss_split()
    if not split:
        pytest.skip("no /proc/self/status here")
    assert set(split) == {"anon", "file"}
    total = _rss_bytes()
    assert total is not None
    assert 0 < split["anon"] <= total and 0 < split["file"] <= total


def test_traced_allocation_sites_carry_no_machine_paths() -> None:
    from retention.vllm_adapter.diagnostics import _short_frame

    class Frame:
        def __init__(self, filename: str, lineno: int) -> None:
            self.filename, self.lineno = filename, lineno

    assert _short_frame(Frame("/x/venv/lib/python3.11/site-packages/vllm/a.py", 3)) == "vllm/a.py:3"
    assert _short_frame(Frame("/opt/py/lib/python3.11/pickle.py", 9)) == "pickle.py:9"
    root = __import__("pathlib").Path(heap_trim.__file__).resolve().parents[2]
    assert _short_frame(Frame(f"{root}/retention/x.py", 1)) == "retention/x.py:1"
