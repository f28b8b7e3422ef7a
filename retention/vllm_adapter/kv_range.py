"""Free a block-aligned token range of a LIVE request's KV cache (vLLM scheduler side).

This is the KV range-free primitive of the thin, version-pinned adapter: free functions over
vLLM's own objects (`KVCacheManager`, its coordinator's `SingleTypeKVCacheManager`s and the
shared `BlockPool`). It touches scheduler-side bookkeeping only; the worker's block table, the
per-token arrays of the `Request` and the RoPE position offset are the caller's job (see
"Caller contract" below).

Theory of operation
===================

Invariant (vLLM's, kept by this module). For a running request ``r`` of a full-attention
manager ``m``, ``m.req_to_blocks[r][i]`` holds the KV of the request's KV-token indices
``[i * bs, (i + 1) * bs)`` (``bs = m.block_size``), and ``len(m.req_to_blocks[r])`` is
``cdiv(tokens with a slot, bs)``. A block's ``ref_cnt`` is the number of request tables that
hold it; a block with ``ref_cnt == 0`` sits in ``block_pool.free_block_queue``; null block 0 is
never in a full-attention table. Free blocks + distinct blocks held == ``num_blocks - 1``.

Removal, not nulling. vLLM's own ``_remove_blocks_in_range`` (sliding window, R-SWA) replaces
freed positions with the null block. That is only correct for layers whose attention mask
already excludes those positions. Full attention reads every position up to the sequence
length, so a nulled slot would be attended to as zero/garbage KV. Eviction therefore
*compacts* the table: the removed positions are deleted from the list (in place, so every view
of that list stays consistent) and the blocks after them move down. Because only whole blocks
are removed, every later block keeps its fill level, so the partially filled tail block is still
the last one and appends continue into it.

Why the range is rounded inward. Only whole blocks can be returned to the pool; rounding
outward would throw away tokens the caller asked to keep. ``[start, end)`` becomes
``[ceil(start / bs) * bs, floor(end / bs) * bs)``.

Prefix-cache rule (the part that must not be gotten wrong). A hash in
``block_pool.cached_block_hash_to_block`` promises "this block holds the KV of the token
prefix the hash chains over, computed at those positions, with that whole prefix as context".
After an eviction:

* The removed blocks are dropped from the index (``BlockPool.evict_blocks``, the public path
  that KV connectors use for invalid blocks; it resets the block's hash and emits
  ``BlockRemoved`` events) *before* they are decref'd, so a freed block goes back to the free
  queue unhashed (front of the queue, reused first) and can never be handed to another request
  as a prefix hit. A removed block that another request still holds (it reached it through a
  prefix hit, ``ref_cnt > 1``) is only decref'd, never freed; it is still dropped from the
  index. Its content stays valid for the other request, which keeps it in its own table, and
  that request never re-caches it (its ``num_cached_block`` is already past it). The price is
  that NEW requests cannot hit that prefix any more and will recompute it; the gain is one
  simple guarantee: an evicted block is unreachable through the index until the pool reuses it.
* Every hashed block of the request *after* the first removed position is dropped from the
  index too ("suffix invalidation"). Hashes chain, so those blocks were reachable only through
  the removed ones anyway (or through an identical duplicate); removing them costs no hits and
  keeps the index free of blocks whose neighbourhood the caller is about to rewrite (position
  offsets, any in-place KV edit of a compacted table). Blocks before the first removed
  position keep their hashes: their prefix is untouched and they remain valid hits.
* The request is then *prefix-cache frozen*: ``m.num_cached_block[r]`` is set to
  ``PREFIX_CACHE_FROZEN`` (``sys.maxsize``). vLLM's ``cache_blocks`` caches table positions
  ``num_cached_block .. num_full_blocks`` under ``request.block_hashes[i]`` — hashes of the
  ORIGINAL token chain indexed by position. After compaction, table position ``i`` no longer
  holds original block ``i`` (and blocks written later are computed without the evicted
  context), so caching them would publish wrong KV under a valid-looking hash and corrupt
  OTHER requests. With ``num_cached_block >= num_full_blocks`` forever, ``cache_blocks``
  returns before it reads any hash. The value is otherwise only tested with ``in`` by vLLM
  0.32 ("is this request running": the allocate fast path), which stays true. Partial-tail
  caching (``_cache_partial_tail_block``) is not guarded by ``num_cached_block``; it only runs
  when ``block_size != hash_block_size``, which this module refuses.

Caller contract (the scheduler)
===============================

After ``evict_token_range_for_request`` returns ``(a, b, n)`` with ``n > 0`` (``b - a`` tokens
removed, ``n = (b - a) // bs`` blocks), the caller must, before the next ``allocate_slots``:

1. Decrease ``request.num_computed_tokens`` by ``b - a``. ``allocate_slots`` sizes the table as
   ``cdiv(num_computed_tokens + new, bs)``; without this it allocates ``n`` extra blocks and the
   slot mapping is off by ``b - a``. Only evict committed tokens: pass
   ``num_committed_tokens=request.num_computed_tokens - request.num_in_flight_tokens``.
2. Remove KV-token indices ``[a, b)`` from every per-token array that is indexed like the KV
   (``_all_token_ids``, ``prompt_token_ids``/``num_prompt_tokens`` or ``_output_token_ids``,
   multimodal offsets, ...), or otherwise keep "tokens to schedule = num_tokens -
   num_computed_tokens" right, or the scheduler recomputes ``b - a`` tokens.
3. Keep a RoPE position offset of ``b - a`` for tokens after the range (positions are no longer
   KV indices) and send the compacted block table to the worker: running requests normally
   only ship *new* block ids, and the worker's table still has the old layout.
4. ``request.block_hashes`` entries past ``a // hash_block_size`` no longer describe this
   request's KV. The frozen manager never reads them, but vLLM's preemption frees the blocks
   and pops ``num_cached_block`` (the freeze is lost) and the resumed request does a prefix
   lookup with those hashes and then caches its recomputed blocks under them. So for a request
   that ever had a range evicted, switch its prefix-cache reads off
   (``capabilities.skip_prefix_cache_reads``: ``skip_reading_prefix_cache`` on vLLM 0.32,
   ``prefix_cache_hit_limit = 0`` where vLLM has it, reset by vLLM at every fold) and call
   ``freeze_request_prefix_caching(kv_cache_manager, request_id)`` right before the first
   ``allocate_slots`` after a resume (or avoid preempting such requests).
5. Not supported: speculative-decode lookahead slots inside the range, KV connectors with
   external/async loads for the request, hybrid (more than one KV-cache group) models, and
   attention types other than plain full attention (refused with an exception).

Errors never leave partial state: everything is validated before anything is mutated.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import Final

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.single_type_kv_cache_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
)

from retention.vllm_adapter.capabilities import vllm_capabilities
from retention.vllm_adapter.errors import VLLMAdapterError

__all__ = [
    "PREFIX_CACHE_FROZEN",
    "HybridKVConfigError",
    "InvalidKVRangeError",
    "KVRangeError",
    "UnsupportedKVCacheManagerError",
    "align_token_range",
    "cached_block_ids",
    "cached_index_entries",
    "evict_token_range_for_request",
    "free_blocks_of_request",
    "free_token_range_in_all_groups",
    "freeze_prefix_caching",
    "freeze_request_prefix_caching",
    "is_hashed_block",
    "is_prefix_caching_frozen",
]

PREFIX_CACHE_FROZEN: Final[int] = sys.maxsize
"""``num_cached_block`` value of a request whose table was compacted: never cache again."""


class KVRangeError(VLLMAdapterError, ValueError):
    """Base class: a KV range cannot be freed; nothing was changed."""


class HybridKVConfigError(KVRangeError):
    """The KV cache has more (or fewer) than one KV-cache group; token ranges are per group."""


class UnsupportedKVCacheManagerError(KVRangeError):
    """The group's manager is not plain full attention (or its layout is not supported)."""


class InvalidKVRangeError(KVRangeError):
    """Unknown request, or a range/index outside the request's allocated (committed) blocks."""


def align_token_range(start: int, end: int, block_size: int) -> tuple[int, int]:
    """Round ``[start, end)`` inward to whole blocks; an empty result is ``(s, s)``.

    ``s = ceil(start / block_size) * block_size``; ``e = floor(end / block_size) * block_size``;
    returns ``(s, e)`` if ``e > s`` else ``(s, s)``.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    aligned_start = -(-start // block_size) * block_size
    aligned_end = end // block_size * block_size
    if aligned_end <= aligned_start:
        return aligned_start, aligned_start
    return aligned_start, aligned_end


def _check_manager(manager: SingleTypeKVCacheManager) -> None:
    # Subclasses of FullAttentionManager (R-SWA, sink, circular buffer, HiSparse) keep nulls,
    # rings or side tables indexed by position: compaction would break them.
    if type(manager) is not FullAttentionManager:
        raise UnsupportedKVCacheManagerError(
            f"KV range eviction supports plain full attention only; KV-cache group "
            f"{manager.kv_cache_group_id} uses {type(manager).__name__}"
        )
    if manager.enable_caching and manager.block_pool.hash_block_size != manager.block_size:
        raise UnsupportedKVCacheManagerError(
            f"block_size {manager.block_size} != hash_block_size "
            f"{manager.block_pool.hash_block_size}: partial-block prefix caching indexes blocks "
            f"by position and cannot follow a compacted table"
        )


def _request_blocks(manager: SingleTypeKVCacheManager, request_id: str) -> list[KVCacheBlock]:
    # `req_to_blocks` is a defaultdict: test membership, never index an unknown id.
    if request_id not in manager.req_to_blocks:
        raise InvalidKVRangeError(
            f"request {request_id!r} has no blocks in KV-cache group {manager.kv_cache_group_id}"
        )
    blocks: list[KVCacheBlock] = manager.req_to_blocks[request_id]
    return blocks


def _validated_indices(
    manager: SingleTypeKVCacheManager, request_id: str, block_indices: Iterable[int]
) -> list[int]:
    _check_manager(manager)
    blocks = _request_blocks(manager, request_id)
    indices = list(block_indices)
    ordered = sorted(set(indices))
    if len(ordered) != len(indices):
        raise InvalidKVRangeError(f"duplicate block indices in {indices}")
    if ordered and (ordered[0] < 0 or ordered[-1] >= len(blocks)):
        raise InvalidKVRangeError(
            f"block indices {ordered[0]}..{ordered[-1]} outside the {len(blocks)} blocks of "
            f"request {request_id!r}"
        )
    for i in ordered:
        block = blocks[i]
        if block.is_null or block.ref_cnt <= 0:
            raise InvalidKVRangeError(
                f"block {block.block_id} at position {i} of request {request_id!r} is "
                f"{'the null block' if block.is_null else 'not referenced'}; refusing to free it"
            )
    # A pending partial-hit copy-on-write targets a table position (only with
    # block_size != hash_block_size, refused above; checked in case that ever changes).
    if request_id in manager._partial_hit_reqs:  # reason: no public accessor in vLLM 0.32
        raise UnsupportedKVCacheManagerError(
            f"request {request_id!r} has a pending copy-on-write of a partial prefix hit"
        )
    return ordered


def is_hashed_block(manager: SingleTypeKVCacheManager, block: KVCacheBlock) -> bool:
    pool = manager.block_pool
    return block.block_hash is not None or block.block_id in pool.cached_block_hashes_by_block


def cached_index_entries(block_pool: BlockPool) -> Iterator[tuple[bytes, list[int]]]:
    """The prefix-cache index as (hash with group id, block ids cached under it) (for checks
    and tests).

    The index maps a hash to blocks on vLLM 0.32/0.33 (one block, or a dict of them) and to
    block ids on 0.34 (one id; a hash held by several blocks keeps them all in ``_dup_ids``).
    """
    index = block_pool.cached_block_hash_to_block
    # reason: vLLM has no public iteration over the index
    if vllm_capabilities().block_map_holds_ids:
        for key, block_id in index._cache.items():
            dup = index._dup_ids.get(key)
            yield key, list(dup) if dup is not None else [block_id]
        return
    for key, value in index._cache.items():
        yield key, [value.block_id] if isinstance(value, KVCacheBlock) else list(value)


def cached_block_ids(block_pool: BlockPool) -> set[int]:
    """Every block id the prefix-cache index can return."""
    return {block_id for _, ids in cached_index_entries(block_pool) for block_id in ids}


def freeze_prefix_caching(manager: SingleTypeKVCacheManager, request_id: str) -> None:
    """Mark ``request_id`` so that ``manager`` never caches (hashes) any of its blocks again.

    Idempotent. Also valid before the request's first allocation (e.g. right before the first
    ``allocate_slots`` after a resume); then the request must get no prefix-cache hits
    (``capabilities.skip_prefix_cache_reads``), since vLLM treats a request present in
    ``num_cached_block`` as running. ``manager.free`` / preemption clears the mark.
    """
    manager.num_cached_block[request_id] = PREFIX_CACHE_FROZEN


def is_prefix_caching_frozen(manager: SingleTypeKVCacheManager, request_id: str) -> bool:
    """Whether ``request_id`` is frozen out of prefix caching in ``manager``."""
    num_cached: int | None = manager.num_cached_block.get(request_id)
    return num_cached == PREFIX_CACHE_FROZEN


def freeze_request_prefix_caching(kv_cache_manager: KVCacheManager, request_id: str) -> None:
    """``freeze_prefix_caching`` in every KV-cache group of ``kv_cache_manager``."""
    for manager in kv_cache_manager.coordinator.single_type_managers:
        freeze_prefix_caching(manager, request_id)


def _free_validated(
    manager: SingleTypeKVCacheManager, request_id: str, ordered: Sequence[int]
) -> list[int]:
    if not ordered:
        return []
    blocks = manager.req_to_blocks[request_id]
    first = ordered[0]
    # 1. Drop the removed blocks and the request's later blocks from the prefix-cache index
    #    while the request still holds them (so the pool never sees a hashed ref_cnt == 0
    #    block that we are about to invalidate).
    stale = {block.block_id for block in blocks[first:] if is_hashed_block(manager, block)}
    if stale:
        manager.block_pool.evict_blocks(stale)
    # 2. Compact the table in place (other views of this list stay in sync).
    removed_set = set(ordered)
    removed = [blocks[i] for i in ordered]
    blocks[:] = [block for i, block in enumerate(blocks) if i not in removed_set]
    # 3. Positions no longer match request.block_hashes: never cache this request again.
    freeze_prefix_caching(manager, request_id)
    # 4. Decref; blocks nobody else holds go back to the free queue (tail first, like free()).
    manager.block_pool.free_blocks(reversed(removed))
    return [block.block_id for block in removed]


def free_blocks_of_request(
    manager: SingleTypeKVCacheManager, request_id: str, block_indices: Iterable[int]
) -> list[int]:
    """Remove the given block-table positions of a live request from one manager.

    The positions (any set, need not be contiguous) are deleted from
    ``manager.req_to_blocks[request_id]`` (compaction, not nulling), every hashed block at or
    after the first removed position is dropped from the prefix-cache index, the request is
    prefix-cache frozen (``num_cached_block[request_id] = PREFIX_CACHE_FROZEN``, even when
    caching is disabled), and the removed blocks are decref'd (freed when no other request
    holds them). Returns the removed block ids in table order; ``[]`` (and no freeze) for no
    indices. Raises ``UnsupportedKVCacheManagerError`` / ``InvalidKVRangeError`` before
    changing anything.
    """
    ordered = _validated_indices(manager, request_id, block_indices)
    return _free_validated(manager, request_id, ordered)


def free_token_range_in_all_groups(
    coordinator: KVCacheCoordinator, request_id: str, start: int, end: int
) -> tuple[list[int], ...]:
    """Free KV-token range ``[start, end)`` of ``request_id`` in every KV-cache group.

    ``start`` and ``end`` must be multiples of every group's block size. All groups are
    validated before any is changed. Returns the removed block ids per group, in group order.
    """
    plans: list[tuple[SingleTypeKVCacheManager, list[int]]] = []
    for manager in coordinator.single_type_managers:
        bs = manager.block_size
        if start < 0 or end < start or start % bs or end % bs:
            raise InvalidKVRangeError(
                f"token range [{start}, {end}) is not a block-aligned range for block size {bs} "
                f"(KV-cache group {manager.kv_cache_group_id})"
            )
        plans.append(
            (manager, _validated_indices(manager, request_id, range(start // bs, end // bs)))
        )
    return tuple(_free_validated(manager, request_id, ordered) for manager, ordered in plans)


def evict_token_range_for_request(
    kv_cache_manager: KVCacheManager,
    request_id: str,
    start: int,
    end: int,
    *,
    num_committed_tokens: int | None = None,
) -> tuple[int, int, int]:
    """Free the whole blocks inside KV-token range ``[start, end)`` of a live request.

    Returns ``(aligned_start, aligned_end, num_freed_blocks)`` where the range is rounded
    inward to whole blocks (see ``align_token_range``); when no whole block fits, nothing is
    changed and ``(aligned_start, aligned_start, 0)`` is returned. ``num_freed_blocks`` counts
    the table positions removed (a block still held by another request through a prefix hit is
    removed from this table but stays allocated). Requires ``0 <= start <= end <= allocated
    tokens`` (``len(table) * block_size``) and, when given, ``end <= num_committed_tokens``.
    Raises ``HybridKVConfigError`` unless there is exactly one KV-cache group,
    ``UnsupportedKVCacheManagerError`` for non-full-attention groups and
    ``InvalidKVRangeError`` for a bad range or unknown request; nothing changes on error.
    See the module docstring for what the caller must do afterwards.
    """
    managers = kv_cache_manager.coordinator.single_type_managers
    if len(managers) != 1:
        raise HybridKVConfigError(
            f"KV range eviction needs exactly one KV-cache group, this model has "
            f"{len(managers)}; token ranges of hybrid models would have to be freed per group"
        )
    manager = managers[0]
    _check_manager(manager)
    blocks = _request_blocks(manager, request_id)
    bs = manager.block_size
    capacity = len(blocks) * bs
    if start < 0 or end < start:
        raise InvalidKVRangeError(f"invalid token range [{start}, {end})")
    if end > capacity:
        raise InvalidKVRangeError(
            f"token range [{start}, {end}) exceeds the {capacity} allocated token slots of "
            f"request {request_id!r}"
        )
    if num_committed_tokens is not None and end > num_committed_tokens:
        raise InvalidKVRangeError(
            f"token range [{start}, {end}) exceeds the {num_committed_tokens} committed tokens "
            f"of request {request_id!r}"
        )
    aligned_start, aligned_end = align_token_range(start, end, bs)
    if aligned_end <= aligned_start:
        return aligned_start, aligned_start, 0
    (freed,) = free_token_range_in_all_groups(
        kv_cache_manager.coordinator, request_id, aligned_start, aligned_end
    )
    return aligned_start, aligned_end, len(freed)
