"""Give the worker's free heap back to the OS after a consolidation (glibc only).

Why: over 1,000 bounded video frames (bench/tail_latency.py, docs/history/benchmarks-2026.md) the worker's
malloc bytes in use stayed flat while its RSS grew ~1 MB per 1,000 frames: glibc keeps what the
large, short-lived activations of re-prefill steps free in its arenas. `malloc_trim(0)` returns
it, at most once per `MIN_INTERVAL_S` per process, so many sessions consolidating together cost
one trim.

Where: `release_after_consolidation`, the worker's one memory step, called by the worker hooks
right after they accept a consolidation's fold record (`positions.py` for 1D RoPE, `mrope.py`):
the one point where the worker learns that a consolidation begins; by then the previous
consolidation's re-prefill activations are free. The fold record's checks (`fold_control.py`)
have no side effects. The diagnostics' `trim_read` (`diagnostics.py`) trims unconditionally
(`trim_now`) before it reads the memory a process holds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from typing import Any, Final

MIN_INTERVAL_S: Final = 5.0
_STATE: dict[str, Any] = {}  # "trim": the bound libc function or None; "last": monotonic time


def libc_function(name: str) -> Any:
    """A function of the C library by name, or None (no such library or symbol: not glibc)."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def _malloc_trim() -> Any:
    if "trim" not in _STATE:
        fn = libc_function("malloc_trim")
        if fn is not None:
            fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
        _STATE["trim"] = fn
    return _STATE["trim"]


def trim_now() -> bool:
    """Return the free heap to the OS now, not rate-limited (diagnostics). False off glibc."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True


def trim_free_heap(now: float | None = None) -> bool:
    """Return the free heap to the OS unless this process did so in the last `MIN_INTERVAL_S`.
    True when it trimmed."""
    fn = _malloc_trim()
    now = time.monotonic() if now is None else now
    if fn is None or now - _STATE.get("last", -MIN_INTERVAL_S) < MIN_INTERVAL_S:
        return False
    _STATE["last"] = now
    fn(0)
    return True


def release_after_consolidation(control: Any) -> bool:
    """The worker's memory step at a fold (`control`: its `FoldControl`): at a consolidation,
    give the free heap back to the OS (rate-limited, `trim_free_heap`). True when it trimmed."""
    return bool(control.consolidates) and trim_free_heap()
