"""vLLM's shared-memory step rings are made resident when a process creates or opens them.

Real `ShmRingBuffer`s of the installed vLLM, in this process; the engine-level check (the
worker's shared memory is flat over 1,000 frames) is in test_video_retention.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from retention.vllm_adapter.introspect import _rss_split
from retention.vllm_adapter.shm_prefault import (
    PREFAULT_BYTES_PER_CHUNK,
    install_shm_prefault,
    prefault_ring,
)

MIB = 1 << 20


def _shmem() -> int:
    split = _rss_split()
    if not split:
        pytest.skip("no /proc/self/status here")
    return split["shmem"]


@pytest.fixture(scope="module")
def ring_class() -> Any:
    install_shm_prefault()
    from vllm.distributed.device_communicators.shm_broadcast import ShmRingBuffer

    return ShmRingBuffer


def test_a_new_ring_is_resident_up_to_the_prefault_bound(ring_class: Any) -> None:
    before = _shmem()
    ring = ring_class(1, PREFAULT_BYTES_PER_CHUNK, 10)
    grown = _shmem() - before
    # All ten chunks (the metadata is a page more); nothing else in this process maps shmem.
    assert 10 * PREFAULT_BYTES_PER_CHUNK <= grown <= 10 * PREFAULT_BYTES_PER_CHUNK + 2 * 4096
    del ring


def test_chunks_larger_than_the_bound_are_resident_only_up_to_it(ring_class: Any) -> None:
    before = _shmem()
    ring = ring_class(1, 4 * PREFAULT_BYTES_PER_CHUNK, 10)
    grown = _shmem() - before
    assert 10 * PREFAULT_BYTES_PER_CHUNK <= grown <= 10 * PREFAULT_BYTES_PER_CHUNK + 2 * 4096
    del ring


def test_prefaulting_reads_only_and_is_repeatable(ring_class: Any) -> None:
    ring = ring_class(2, MIB, 4)
    with ring.get_data(1) as chunk:
        chunk[:5] = b"hello"
    before = _shmem()
    touched = prefault_ring(ring)
    assert touched >= 4 * MIB
    assert _shmem() == before  # already resident: nothing new
    with ring.get_data(1) as chunk:
        assert bytes(chunk[:5]) == b"hello"
    with ring.get_metadata(0) as flags:
        assert bytes(flags) == b"\x00\x00\x00"  # written flag and two reader flags untouched
    del ring


def test_installing_twice_wraps_the_constructor_once(ring_class: Any) -> None:
    init = ring_class.__init__
    install_shm_prefault()
    assert ring_class.__init__ is init
