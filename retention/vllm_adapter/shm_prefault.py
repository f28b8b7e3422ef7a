"""Make vLLM's shared-memory message rings resident when a process opens them.

Why: EngineCore sends each step to the worker through a ring of shared memory
(`shm_broadcast.ShmRingBuffer`, 10 chunks) and the worker answers through another. A chunk's
pages become resident the first time a message reaches that far into it, so a process's RSS steps
up whenever a chunk carries a larger message than before. Over 1,000 video frames the worker's
shared memory went 0.2 -> 3.7 MiB in steps (docs/history/benchmarks-2026.md, session 15): a ring filling up
to its bound, not a leak, yet it reads as a slope of ~0.6 MiB per 1k frames. Touching every
page a message can reach once, at start-up, makes that bound resident from the start: memory is
constant afterwards, and no frame pays the page faults (as realtime programs pre-fault).

The bound: `PREFAULT_BYTES_PER_CHUNK` of each chunk. The server caps vLLM's chunk at that size
(`VLLM_MQ_MAX_CHUNK_BYTES_MB`, realtime/engine.py), so a larger step message goes through
vLLM's own overflow socket instead of reaching new pages of the ring. The worker's answer ring
has vLLM's fixed 24 MiB chunks; its messages (sampled tokens) stay far inside the prefix.
`VLLM_REALTIME_SHM_PREFAULT=0` turns it off (bench.tail_latency's A/B).
"""

from __future__ import annotations

import functools
import mmap
import os
from typing import Any, Final

from retention.vllm_adapter.import_hooks import patch_on_import

PREFAULT_BYTES_PER_CHUNK: Final = 1 << 20
SHM_BROADCAST_MODULE: Final = "vllm.distributed.device_communicators.shm_broadcast"
_MARK: Final = "_vllm_realtime_prefaulted"
SHM_PREFAULT_ENV: Final = "VLLM_REALTIME_SHM_PREFAULT"


def prefault_ring(ring: Any, per_chunk: int = PREFAULT_BYTES_PER_CHUNK) -> int:
    """Read one byte of every page a message can occupy (up to `per_chunk` bytes of each
    chunk) and the flags after them, so the pages are mapped now. Reading never changes the
    ring, so this is safe on either side at any time. Returns the bytes made resident."""
    shm = getattr(ring, "shared_memory", None)  # absent where vLLM opened no segment
    buf = None if shm is None else shm.buf
    if buf is None:
        return 0
    page = mmap.PAGESIZE
    spans = [
        (ring.data_offset + i * ring.max_chunk_bytes, min(ring.max_chunk_bytes, per_chunk))
        for i in range(ring.max_chunks)
    ]
    spans.append((ring.metadata_offset, ring.total_bytes_of_buffer - ring.metadata_offset))
    touched = 0
    for start, length in spans:
        for offset in range(start, min(start + length, len(buf)), page):
            buf[offset]  # the read is the point: it faults the page in
        touched += length
    return touched


def _patch_ring_buffer(module: Any) -> None:
    ring_class = module.ShmRingBuffer
    if getattr(ring_class, _MARK, False):
        return
    original_init = ring_class.__init__

    @functools.wraps(original_init)
    def init_then_prefault(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        prefault_ring(self)

    ring_class.__init__ = init_then_prefault
    setattr(ring_class, _MARK, True)


def install_shm_prefault() -> None:
    """Idempotently pre-fault every ring this process creates or opens (EngineCore: the step
    ring it writes; worker: both rings). Rings opened before this runs are not touched."""
    if os.environ.get(SHM_PREFAULT_ENV, "1") == "0":
        return
    patch_on_import(SHM_BROADCAST_MODULE, _patch_ring_buffer)
