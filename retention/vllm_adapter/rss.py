"""This process's resident memory, read from /proc: what the engine utilities (introspect.py)
and the memory diagnostics (diagnostics.py) both report. Its own module so that neither of those
imports the other to read it."""

from __future__ import annotations


def _rss_bytes() -> int | None:
    """Resident set size of this (the EngineCore) process; None where /proc is missing."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


_RSS_KINDS = {"RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}


def _rss_split() -> dict[str, int]:
    """RSS by kind (bytes): "anon" (heaps, mmapped allocations), "file" (pages of mapped
    files: libraries, weights), which grows as rarely used code is first touched and is not a
    leak, and "shmem" (shared memory segments). Empty where /proc is missing."""
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                kind = _RSS_KINDS.get(line.split(maxsplit=1)[0] if line.strip() else "")
                if kind is not None:
                    out[kind] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return out
