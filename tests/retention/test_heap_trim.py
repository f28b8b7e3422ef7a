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
    assert set(split) == {"anon", "file", "shmem"}
    total = _rss_bytes()
    assert total is not None
    assert 0 < split["anon"] <= total and 0 < split["file"] <= total
    assert 0 <= split["shmem"] <= total
    # statm's resident pages are these three (read a moment apart: allow a little movement)
    assert abs(sum(split.values()) - total) <= 1 << 20


def test_traced_allocation_sites_carry_no_machine_paths() -> None:
    from retention.vllm_adapter.diagnostics import _short_frame

    class Frame:
        def __init__(self, filename: str, lineno: int) -> None:
            self.filename, self.lineno = filename, lineno

    assert _short_frame(Frame("/x/venv/lib/python3.11/site-packages/vllm/a.py", 3)) == "vllm/a.py:3"
    assert _short_frame(Frame("/opt/py/lib/python3.11/pickle.py", 9)) == "pickle.py:9"
    root = __import__("pathlib").Path(heap_trim.__file__).resolve().parents[2]
    assert _short_frame(Frame(f"{root}/retention/x.py", 1)) == "retention/x.py:1"


def test_thread_arena_heaps_are_counted_from_the_maps() -> None:
    """The check that MALLOC_ARENA_MAX took effect in an engine process (bench.tail_latency):
    a thread arena is a 64 MiB-aligned anonymous region, used part + reserve = 64 MiB."""
    from retention.vllm_adapter.diagnostics import thread_arena_heaps

    maps = "\n".join(
        [
            "55d0c0000000-55d0c0100000 rw-p 00000000 00:00 0 [heap]",  # main arena: named
            "7f1a44000000-7f1a44021000 rw-p 00000000 00:00 0",  # arena 1: used part
            "7f1a44021000-7f1a48000000 ---p 00000000 00:00 0",  # ... and its reserve
            "7f1a50000000-7f1a54000000 rw-p 00000000 00:00 0",  # arena 2, all used
            "7f1a60000000-7f1a60100000 rw-p 00000000 00:00 0",  # aligned, but 1 MiB only
            "7f1a61000000-7f1a65000000 rw-p 00000000 00:00 0",  # 64 MiB, not aligned
            "7f1a70000000-7f1a70021000 r-xp 00000000 08:01 42 /usr/lib/libc.so.6",
        ]
    )
    assert thread_arena_heaps(maps) == 2
    assert thread_arena_heaps("") == 0
    assert isinstance(thread_arena_heaps(), int | None)


def test_trim_read_returns_memory_held_after_trimming_without_walking_objects() -> None:
    from retention.vllm_adapter.diagnostics import _heap_stats

    out = _heap_stats(None, "trim_read")
    assert out["rss_bytes"] is None or out["rss_bytes"] > 0
    assert "python_objects" not in out  # the cheap read: no gc.get_objects() walk
    if out["rss_split_bytes"]:
        assert set(out["rss_split_bytes"]) == {"anon", "file", "shmem"}


def test_trim_now_is_not_rate_limited(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(heap_trim, "_STATE", {"trim": calls.append, "last": 1e18})
    assert heap_trim.trim_now() and heap_trim.trim_now()
    assert calls == [0, 0]
    monkeypatch.setattr(heap_trim, "_STATE", {"trim": None})
    assert not heap_trim.trim_now()


def test_checking_a_fold_record_releases_no_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The validator has no side effect; the trim is the worker hooks' own named step."""
    from types import SimpleNamespace

    from retention.vllm_adapter.fold_control import FoldControl, accept_fold

    calls: list[int] = []
    monkeypatch.setattr(heap_trim, "_STATE", {"trim": calls.append})
    state = SimpleNamespace(req_id="r")
    accept_fold(state, FoldControl(fold=0, reset=True))
    accept_fold(state, FoldControl(fold=1, reset=True))  # a consolidation
    assert calls == []


def test_memory_is_released_after_a_consolidation_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from retention.vllm_adapter.fold_control import FoldControl

    calls: list[int] = []
    monkeypatch.setattr(heap_trim, "_STATE", {"trim": calls.append})
    first = FoldControl(fold=0, reset=True)  # the first chunk's prefill: nothing freed yet
    plain = FoldControl(fold=3, position_offset=64, held_before=128, evicted=((0, 64),))
    consolidation = FoldControl(fold=4, reset=True)
    assert not first.consolidates and not plain.consolidates and consolidation.consolidates
    assert not heap_trim.release_after_consolidation(first)
    assert not heap_trim.release_after_consolidation(plain)
    assert heap_trim.release_after_consolidation(consolidation)
    assert calls == [0]
