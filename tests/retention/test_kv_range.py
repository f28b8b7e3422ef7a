"""KV range-free primitive (retention.vllm_adapter.kv_range) against real vLLM 0.32 classes.

The KV cache manager, coordinator, block pool and requests are vLLM's own, built directly (as
vLLM's tests/v1/core/test_prefix_caching.py does); no engine, no model, no torch kernels.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import (
    get_block_hash,
    get_request_block_hasher,
    init_none_hash,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request

from retention.vllm_adapter.capabilities import skip_prefix_cache_reads
from retention.vllm_adapter.kv_range import (
    PREFIX_CACHE_FROZEN,
    HybridKVConfigError,
    InvalidKVRangeError,
    KVRangeError,
    UnsupportedKVCacheManagerError,
    align_token_range,
    cached_block_ids,
    cached_index_entries,
    evict_token_range_for_request,
    free_blocks_of_request,
    free_token_range_in_all_groups,
    freeze_request_prefix_caching,
    is_prefix_caching_frozen,
)

# Needs no model runner: `make compat` also runs it against every supported vLLM.
pytestmark = pytest.mark.compat

init_none_hash(sha256)

MAX_MODEL_LEN = 100_000


# --------------------------------------------------------------------------- factories


def full_spec(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )


def make_manager(
    num_blocks: int,
    block_size: int,
    *,
    enable_caching: bool = True,
    specs: list[KVCacheSpec] | None = None,
) -> KVCacheManager:
    group_specs = specs if specs is not None else [full_spec(block_size)]
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(group_specs)
        ],
    )
    return KVCacheManager(
        config,
        max_model_len=MAX_MODEL_LEN,
        scheduler_block_size=block_size,
        hash_block_size=block_size,
        enable_caching=enable_caching,
    )


def make_request(request_id: str, tokens: list[int], block_size: int) -> Request:
    return Request(
        request_id,
        list(tokens),
        SamplingParams(max_tokens=1000),
        None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def prefill(manager: KVCacheManager, request: Request) -> list[int]:
    """Schedule and 'compute' the whole prompt (one step); return the prefix-hit block ids."""
    hit, num_hit, _ = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit)
    assert new is not None
    request.num_computed_tokens = request.num_tokens
    ids: list[int] = hit.get_block_ids()[0]
    return ids


def append(manager: KVCacheManager, request: Request, tokens: list[int]) -> None:
    request.append_output_token_ids(tokens)
    assert manager.allocate_slots(request, len(tokens)) is not None
    request.num_computed_tokens += len(tokens)


def table(manager: KVCacheManager, request_id: str) -> list[int]:
    return [
        b.block_id for b in manager.coordinator.single_type_managers[0].req_to_blocks[request_id]
    ]


def hit_ids(manager: KVCacheManager, tokens: list[int], block_size: int) -> list[int]:
    probe = make_request("probe", tokens, block_size)
    ids: list[int] = manager.get_computed_blocks(probe)[0].get_block_ids()[0]
    return ids


def reachable_block_ids(manager: KVCacheManager) -> set[int]:
    """Every block id the prefix-cache index can return."""
    return cached_block_ids(manager.block_pool)


# --------------------------------------------------------------------------- hand-made cases


def test_align_token_range_rounds_inward() -> None:
    assert align_token_range(10, 50, 16) == (16, 48)
    assert align_token_range(16, 48, 16) == (16, 48)
    assert align_token_range(0, 64, 16) == (0, 64)
    assert align_token_range(10, 20, 16) == (16, 16)
    assert align_token_range(17, 31, 16) == (32, 32)
    assert align_token_range(5, 5, 16) == (16, 16)
    with pytest.raises(ValueError):
        align_token_range(0, 1, 0)


def test_evict_middle_blocks_exact_ids() -> None:
    m = make_manager(11, 16)
    req = make_request("a", list(range(64)), 16)
    prefill(m, req)
    assert table(m, "a") == [1, 2, 3, 4]
    pool = m.block_pool
    free_before = pool.get_num_free_blocks()
    assert free_before == 6

    assert evict_token_range_for_request(m, "a", 10, 50) == (16, 48, 2)

    assert table(m, "a") == [1, 4]
    assert pool.get_num_free_blocks() == free_before + 2
    for block_id in (2, 3):
        block = pool.blocks[block_id]
        assert block.ref_cnt == 0
        assert block.block_hash is None
    # Suffix invalidation: block 4 (after the range) is no longer hashed; block 1 still is.
    assert pool.blocks[4].block_hash is None
    assert pool.blocks[1].block_hash is not None
    assert reachable_block_ids(m) == {1}
    sm = m.coordinator.single_type_managers[0]
    assert sm.num_cached_block["a"] == PREFIX_CACHE_FROZEN
    assert is_prefix_caching_frozen(sm, "a")
    # Unhashed freed blocks go to the front of the free queue: reused first, tail first.
    assert [b.block_id for b in pool.free_block_queue.get_all_free_blocks()[:2]] == [3, 2]


def test_caller_contract_append_after_eviction_never_caches() -> None:
    m = make_manager(11, 16)
    req = make_request("a", list(range(64)), 16)
    prefill(m, req)
    _, _, n = evict_token_range_for_request(m, "a", 16, 48, num_committed_tokens=64)
    assert n == 2
    req.num_computed_tokens -= 32  # the caller's part (token arrays are left alone here)
    append(m, req, list(range(100, 116)))  # fills 32 + 16 = 48 KV tokens: one new full block
    assert table(m, "a") == [1, 4, 3]
    sm = m.coordinator.single_type_managers[0]
    assert sm.num_cached_block["a"] == PREFIX_CACHE_FROZEN
    assert all(m.block_pool.blocks[i].block_hash is None for i in (4, 3))
    assert reachable_block_ids(m) == {1}


def test_prefix_cache_never_serves_evicted_blocks() -> None:
    m = make_manager(20, 16)
    tokens = list(range(64))
    req = make_request("a", tokens, 16)
    prefill(m, req)
    assert hit_ids(m, tokens, 16) == [1, 2, 3]  # max hit is num_tokens - 1
    evict_token_range_for_request(m, "a", 16, 48)
    assert hit_ids(m, tokens, 16) == [1]
    assert hit_ids(m, [*tokens, 7, 8, 9], 16) == [1]
    # A real new request recomputes the rest into fresh blocks and caches those.
    b = make_request("b", tokens, 16)
    assert prefill(m, b) == [1]
    # The freed (unhashed) blocks are reused first, as fresh blocks that b writes anew.
    assert table(m, "b") == [1, 3, 2, 5]
    assert hit_ids(m, tokens, 16) == [1, 3, 2]
    assert m.block_pool.blocks[1].ref_cnt == 2


def test_shared_block_is_only_decrefd_and_uncached() -> None:
    m = make_manager(20, 16)
    tokens = list(range(64))
    a = make_request("a", tokens, 16)
    prefill(m, a)
    b = make_request("b", tokens, 16)
    assert prefill(m, b) == [1, 2, 3]
    assert table(m, "b") == [1, 2, 3, 5]
    pool = m.block_pool
    free_before = pool.get_num_free_blocks()

    assert evict_token_range_for_request(m, "a", 16, 48) == (16, 48, 2)

    assert table(m, "a") == [1, 4]
    assert table(m, "b") == [1, 2, 3, 5]  # untouched
    assert pool.get_num_free_blocks() == free_before  # still held by b
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 1, 1, 1]
    assert pool.blocks[2].block_hash is None and pool.blocks[3].block_hash is None
    assert hit_ids(m, tokens, 16) == [1]
    sm = m.coordinator.single_type_managers[0]
    assert sm.num_cached_block["b"] == 4  # b keeps caching normally
    m.free(b)
    assert pool.blocks[2].ref_cnt == 0 and pool.blocks[3].ref_cnt == 0
    m.free(a)
    assert pool.get_num_free_blocks() == 19


def test_empty_aligned_range_changes_nothing() -> None:
    m = make_manager(11, 16)
    prefill(m, make_request("a", list(range(64)), 16))
    sm = m.coordinator.single_type_managers[0]
    assert evict_token_range_for_request(m, "a", 10, 20) == (16, 16, 0)
    assert evict_token_range_for_request(m, "a", 40, 40) == (48, 48, 0)
    assert table(m, "a") == [1, 2, 3, 4]
    assert sm.num_cached_block["a"] == 4
    assert reachable_block_ids(m) == {1, 2, 3, 4}


def test_evict_everything_then_grow_again() -> None:
    m = make_manager(11, 16)
    req = make_request("a", list(range(40)), 16)  # 2 full blocks + a partial one
    prefill(m, req)
    assert table(m, "a") == [1, 2, 3]
    assert evict_token_range_for_request(m, "a", 0, 40) == (0, 32, 2)
    assert table(m, "a") == [3]  # the partial tail block stays and keeps its fill level
    req.num_computed_tokens -= 32
    append(m, req, list(range(100, 130)))  # 8 + 30 = 38 tokens -> 3 blocks
    assert len(table(m, "a")) == 3 and table(m, "a")[0] == 3
    m.free(req)
    assert m.block_pool.get_num_free_blocks() == 10


def test_validation_errors_leave_state_unchanged() -> None:
    m = make_manager(11, 16)
    prefill(m, make_request("a", list(range(40)), 16))  # 3 blocks, 48 slots
    sm = m.coordinator.single_type_managers[0]
    before = (table(m, "a"), dict(sm.num_cached_block), m.block_pool.get_num_free_blocks())
    bad: list[Callable[[], object]] = [
        lambda: evict_token_range_for_request(m, "nope", 0, 16),
        lambda: evict_token_range_for_request(m, "a", -1, 16),
        lambda: evict_token_range_for_request(m, "a", 20, 10),
        lambda: evict_token_range_for_request(m, "a", 0, 49),
        lambda: evict_token_range_for_request(m, "a", 0, 41, num_committed_tokens=40),
        lambda: free_blocks_of_request(sm, "a", [0, 0]),
        lambda: free_blocks_of_request(sm, "a", [3]),
        lambda: free_blocks_of_request(sm, "a", [-1]),
        lambda: free_blocks_of_request(sm, "nope", [0]),
        lambda: free_token_range_in_all_groups(m.coordinator, "a", 8, 16),
        lambda: free_token_range_in_all_groups(m.coordinator, "a", 0, 64),
    ]
    for call in bad:
        with pytest.raises(InvalidKVRangeError):
            call()
    assert "nope" not in sm.req_to_blocks  # the defaultdict was not grown
    assert (table(m, "a"), dict(sm.num_cached_block), m.block_pool.get_num_free_blocks()) == before
    assert issubclass(InvalidKVRangeError, KVRangeError) and issubclass(KVRangeError, ValueError)


def test_free_blocks_of_request_non_contiguous() -> None:
    m = make_manager(11, 16)
    prefill(m, make_request("a", list(range(64)), 16))
    sm = m.coordinator.single_type_managers[0]
    assert free_blocks_of_request(sm, "a", [2, 0]) == [1, 3]
    assert table(m, "a") == [2, 4]
    assert reachable_block_ids(m) == set()  # everything from position 0 on is invalidated
    assert free_blocks_of_request(sm, "a", []) == []
    assert m.block_pool.get_num_free_blocks() == 8


def test_hybrid_config_refused() -> None:
    for caching in (True, False):
        m = make_manager(20, 16, enable_caching=caching, specs=[full_spec(16), full_spec(16)])
        prefill(m, make_request("a", list(range(64)), 16))
        with pytest.raises(HybridKVConfigError):
            evict_token_range_for_request(m, "a", 16, 48)
        assert [len(s.req_to_blocks["a"]) for s in m.coordinator.single_type_managers] == [4, 4]
    assert issubclass(HybridKVConfigError, ValueError)


def test_sliding_window_manager_refused() -> None:
    spec = SlidingWindowSpec(
        block_size=16, num_kv_heads=1, head_size=1, dtype=torch.float32, sliding_window=32
    )
    m = make_manager(20, 16, specs=[spec])
    prefill(m, make_request("a", list(range(64)), 16))
    with pytest.raises(UnsupportedKVCacheManagerError):
        evict_token_range_for_request(m, "a", 16, 48)
    with pytest.raises(UnsupportedKVCacheManagerError):
        free_blocks_of_request(m.coordinator.single_type_managers[0], "a", [1])


def test_without_prefix_caching() -> None:
    m = make_manager(11, 16, enable_caching=False)
    req = make_request("a", list(range(64)), 16)
    prefill(m, req)
    assert evict_token_range_for_request(m, "a", 10, 50) == (16, 48, 2)
    assert table(m, "a") == [1, 4]
    req.num_computed_tokens -= 32
    append(m, req, [1] * 20)
    assert len(table(m, "a")) == 4
    m.free(req)
    assert m.block_pool.get_num_free_blocks() == 10


def test_resume_after_preemption_with_refreeze() -> None:
    m = make_manager(20, 16)
    tokens = list(range(64))
    req = make_request("a", tokens, 16)
    prefill(m, req)
    evict_token_range_for_request(m, "a", 16, 48)
    req.num_computed_tokens -= 32
    # Preempt: vLLM frees the blocks (and forgets the freeze), recompute from scratch later.
    m.free(req)
    req.num_computed_tokens = 0
    sm = m.coordinator.single_type_managers[0]
    assert "a" not in sm.num_cached_block
    # Contract: no prefix reads, re-freeze before the first allocate_slots of the resume.
    skip_prefix_cache_reads(req)
    freeze_request_prefix_caching(m, "a")
    hit, num_hit, _ = m.get_computed_blocks(req)
    assert num_hit == 0
    assert m.allocate_slots(req, 32, num_hit, hit) is not None  # the 32 remaining KV tokens
    assert len(table(m, "a")) == 2
    assert all(m.block_pool.blocks[i].block_hash is None for i in table(m, "a"))
    assert sm.num_cached_block["a"] == PREFIX_CACHE_FROZEN


# --------------------------------------------------------------------------- property test

BS = 4
NUM_BLOCKS = 32
Token = tuple[int, int]  # (token id, original position): what a KV slot was computed from
TOKENS = st.integers(0, 2)  # a tiny alphabet, so prompts share prefixes often
PICK = st.integers(0, 1 << 16)  # chooses among the live requests (mod their number)


@dataclass
class Sim:
    request: Request
    kv: list[Token]  # the request's KV in table order (compacted after evictions)
    evicted: bool = False


class Model:
    """Drives a real KVCacheManager like a scheduler would, next to a shadow model.

    The shadow records, for every written block, the exact (token, position) context its KV
    was computed from: the prefix-cache index may only map a hash to a block whose content is
    the prefix the hash chains over, and every prefix hit must match the new request's prefix.
    """

    def __init__(self) -> None:
        self.m = make_manager(NUM_BLOCKS, BS)
        self.pool = self.m.block_pool
        self.sm = self.m.coordinator.single_type_managers[0]
        self.live: dict[str, Sim] = {}
        self.seen_tokens: list[list[int]] = []
        self.content: dict[int, tuple[Token, ...]] = {}
        self.hash_prefix: dict[bytes, tuple[Token, ...]] = {}
        self.evicted_ids: set[int] = set()  # evicted and not handed out again since
        self.ids = itertools.count()
        self.stats: Counter[str] = Counter()

    # ---- scheduler-like helpers

    def record_hashes(self, request: Request) -> None:
        tokens = list(request.all_token_ids)
        for i, h in enumerate(request.block_hashes):
            prefix = tuple((t, p) for p, t in enumerate(tokens[: (i + 1) * BS]))
            assert self.hash_prefix.setdefault(h, prefix) == prefix

    def write(self, sim: Sim, old_len: int) -> None:
        """The 'model' computed KV tokens [old_len, len(sim.kv)): record the full blocks."""
        blocks = self.sm.req_to_blocks[sim.request.request_id]
        for i in range(old_len // BS, len(sim.kv) // BS):
            self.content[blocks[i].block_id] = tuple(sim.kv[: (i + 1) * BS])

    def check_hits(self, kv: list[Token], hit: list[int]) -> None:
        for i, block_id in enumerate(hit):
            assert block_id not in self.evicted_ids
            assert self.content.get(block_id) == tuple(kv[: (i + 1) * BS])

    def prefill(self, sim: Sim) -> bool:
        req = sim.request
        if sim.evicted:  # the documented resume contract for a compacted request
            skip_prefix_cache_reads(req)
            freeze_request_prefix_caching(self.m, req.request_id)
        hit, num_hit, _ = self.m.get_computed_blocks(req)
        hit_list = hit.get_block_ids()[0]
        self.stats["prefix hit"] += bool(hit_list)
        self.check_hits(sim.kv, hit_list)
        new = self.m.allocate_slots(req, len(sim.kv) - num_hit, num_hit, hit)
        if new is None:
            self.m.free(req)  # drops a freeze mark, if any; nothing else was touched
            return False
        self.evicted_ids.difference_update(new.get_block_ids()[0])
        req.num_computed_tokens = len(sim.kv)
        self.write(sim, num_hit)
        return True

    def pick(self, index: int) -> Sim:
        return self.live[sorted(self.live)[index % len(self.live)]]

    # ---- operations

    def new_request(self, base: int, cut: int, fresh: list[int]) -> None:
        tokens = list(fresh)
        if self.seen_tokens and base % 2:
            prefix = self.seen_tokens[base % len(self.seen_tokens)]
            tokens = prefix[: cut % (len(prefix) + 1)] + fresh[:8]
        tokens = tokens or [0]
        req = make_request(f"r{next(self.ids)}", tokens, BS)
        self.record_hashes(req)
        self.seen_tokens.append(list(tokens))
        sim = Sim(req, [(t, p) for p, t in enumerate(tokens)])
        if self.prefill(sim):
            self.live[req.request_id] = sim

    def append(self, index: int, tokens: list[int]) -> None:
        sim = self.pick(index)
        req = sim.request
        blocks = self.sm.req_to_blocks[req.request_id]
        if -(-(len(sim.kv) + len(tokens)) // BS) - len(blocks) > self.pool.get_num_free_blocks():
            return
        self.stats["append after eviction"] += sim.evicted
        first_pos = req.num_tokens
        req.append_output_token_ids(tokens)
        self.record_hashes(req)
        self.seen_tokens.append(list(req.all_token_ids))
        old_len = len(sim.kv)
        sim.kv.extend((t, first_pos + j) for j, t in enumerate(tokens))
        new = self.m.allocate_slots(req, len(tokens))
        assert new is not None
        self.evicted_ids.difference_update(new.get_block_ids()[0])
        req.num_computed_tokens += len(tokens)
        self.write(sim, old_len)

    def evict(self, index: int, start: int, end: int) -> None:
        sim = self.pick(index)
        rid = sim.request.request_id
        before = [b.block_id for b in self.sm.req_to_blocks[rid]]
        cached_before = self.sm.num_cached_block.get(rid)

        a, b, n = evict_token_range_for_request(
            self.m, rid, start, end, num_committed_tokens=len(sim.kv)
        )

        assert a % BS == 0 and b % BS == 0
        after = [blk.block_id for blk in self.sm.req_to_blocks[rid]]
        if n == 0:
            assert a == b == -(-start // BS) * BS and end // BS * BS <= a
            assert after == before
            assert self.sm.num_cached_block.get(rid) == cached_before
            return
        assert start <= a < b <= end  # the aligned range lies inside the requested one
        assert n == (b - a) // BS
        assert after == before[: a // BS] + before[b // BS :]
        assert is_prefix_caching_frozen(self.sm, rid)
        self.stats["evicted"] += 1
        self.stats["evicted a shared block"] += any(
            self.pool.blocks[i].ref_cnt > 0 for i in before[a // BS : b // BS]
        )
        self.evicted_ids.update(before[a // BS : b // BS])
        # The caller's part of the contract.
        sim.kv = sim.kv[:a] + sim.kv[b:]
        sim.request.num_computed_tokens -= b - a
        sim.evicted = True

    def preempt_or_finish(self, index: int, resume: bool) -> None:
        sim = self.pick(index)
        self.m.free(sim.request)
        # Preemption: vLLM recomputes the request from scratch (a request whose KV was all
        # evicted has nothing to recompute; a scheduler would have something to feed it).
        if resume and sim.kv:
            self.stats["resume after eviction"] += sim.evicted
            sim.request.num_computed_tokens = 0
            if self.prefill(sim):
                return
        del self.live[sim.request.request_id]

    # ---- invariants

    def check(self) -> None:
        held = Counter(
            blk.block_id
            for sim in self.live.values()
            for blk in self.sm.req_to_blocks[sim.request.request_id]
        )
        free_ids = [blk.block_id for blk in self.pool.free_block_queue.get_all_free_blocks()]
        # Conservation: free + held by live requests == every block but the null block.
        assert len(free_ids) == len(set(free_ids)) == self.pool.get_num_free_blocks()
        assert self.pool.get_num_free_blocks() + len(held) == NUM_BLOCKS - 1
        assert 0 not in held and 0 not in free_ids
        assert set(free_ids).isdisjoint(held)
        # Exact ref counts: nothing freed twice, nothing leaked.
        for blk in self.pool.blocks[1:]:
            assert blk.ref_cnt == held.get(blk.block_id, 0) >= 0
        for rid, sim in self.live.items():
            assert sim.request.num_computed_tokens == len(sim.kv)
            assert len(self.sm.req_to_blocks[rid]) == -(-len(sim.kv) // BS)
            if sim.evicted:
                assert is_prefix_caching_frozen(self.sm, rid)
        # No evicted block is reachable through the index; the index never lies.
        assert reachable_block_ids(self.m).isdisjoint(self.evicted_ids)
        for block_id in self.evicted_ids:
            assert self.pool.blocks[block_id].block_hash is None
            assert block_id not in self.pool.cached_block_hashes_by_block
        for key, ids in cached_index_entries(self.pool):
            expected = self.hash_prefix[get_block_hash(key)]
            for block_id in ids:
                assert self.content.get(block_id) == expected
        # A new request with identical tokens gets only valid, non-evicted hits.
        for tokens in self.seen_tokens[-6:]:
            self.check_hits([(t, p) for p, t in enumerate(tokens)], hit_ids(self.m, tokens, BS))


@dataclass(frozen=True)
class NewOp:
    base: int  # odd: extend a prefix of an earlier token list (forces prefix hits)
    cut: int
    fresh: list[int]


@dataclass(frozen=True)
class AppendOp:
    index: int
    tokens: list[int]


@dataclass(frozen=True)
class EvictOp:
    index: int
    any_range: bool  # else: whole blocks first..last, edges ragged by off_start / off_end
    x: int
    y: int
    off_start: int
    off_end: int


@dataclass(frozen=True)
class LeaveOp:
    index: int
    resume: bool  # preempt and recompute, else finish


Op = NewOp | AppendOp | EvictOp | LeaveOp
OFFSET = st.integers(0, BS - 1)
EVICT = st.builds(EvictOp, PICK, st.booleans(), PICK, PICK, OFFSET, OFFSET)
OPS: st.SearchStrategy[Op] = st.one_of(
    st.builds(NewOp, PICK, PICK, st.lists(TOKENS, max_size=24)),
    st.builds(AppendOp, PICK, st.lists(TOKENS, min_size=1, max_size=6)),
    EVICT,
    EVICT,  # twice: evictions are what is under test
    st.builds(LeaveOp, PICK, st.booleans()),
)


def evict_bounds(op: EvictOp, length: int) -> tuple[int, int]:
    if op.any_range:
        start = op.x % (length + 1)
        return start, start + op.y % (length - start + 1)
    first = op.x % (length // BS + 1)
    last = first + op.y % (length // BS - first + 1)
    end = min(length, last * BS + op.off_end)
    return min(end, max(0, first * BS - op.off_start)), end


def run_op(model: Model, op: Op) -> None:
    if isinstance(op, NewOp) or not model.live:
        new = op if isinstance(op, NewOp) else NewOp(0, 0, [1, 2, 0, 1, 2, 0])
        model.new_request(new.base, new.cut, new.fresh)
    elif isinstance(op, AppendOp):
        model.append(op.index, op.tokens)
    elif isinstance(op, EvictOp):
        model.evict(op.index, *evict_bounds(op, len(model.pick(op.index).kv)))
    else:
        model.preempt_or_finish(op.index, op.resume)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OPS, min_size=20, max_size=45))
def test_random_allocate_append_evict_free(ops: list[Op]) -> None:
    model = Model()
    for tokens in ([0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1], [1] * 9):
        model.new_request(0, 0, tokens)
    model.check()
    for op in ops:
        run_op(model, op)
        model.check()
    for name, count in model.stats.items():
        if count:
            event(name)
    for sim in list(model.live.values()):
        model.m.free(sim.request)
    model.live.clear()
    model.check()
    assert model.pool.get_num_free_blocks() == NUM_BLOCKS - 1
