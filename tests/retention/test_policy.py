"""Tests of the pure retention policy: exact plans, watermark batching, bookkeeping, properties."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retention.policy import (
    REQUEST_ARGS_KEY,
    EvictionPlan,
    HistorySegment,
    RetentionBudget,
    SessionHistory,
    append_segment,
    apply_eviction,
    consolidate,
    needs_consolidation,
    plan_eviction,
    retained_chunks,
    retained_tokens,
    rotation_runs,
)
from tests.strategies import Scenario, budgets, partial_frees, scenarios

# Needs no model runner: `make compat` also runs it against every supported vLLM.
pytestmark = pytest.mark.compat

# --------------------------------------------------------------------------- helpers


def spans(history: SessionHistory) -> list[tuple[int, int, int, bool]]:
    """(index, start, end, remnant) of every segment, in cache order."""
    return [(s.index, s.start, s.end, s.remnant) for s in history.segments]


def evict(
    history: SessionHistory, budget: RetentionBudget, block_size: int, tail: int
) -> tuple[EvictionPlan, SessionHistory]:
    plan = plan_eviction(history, budget, block_size, tail)
    return plan, apply_eviction(history, plan.ranges, dropped=plan.dropped_segments)


def is_sink(seg: HistorySegment, budget: RetentionBudget) -> bool:
    # Restated here on purpose (not imported): pinned, one of the first sink_chunks, or wholly
    # inside the first sink_tokens tokens.
    return seg.pinned or seg.index < budget.sink_chunks or seg.end <= budget.sink_tokens


def candidates(history: SessionHistory, budget: RetentionBudget, tail: int) -> list[HistorySegment]:
    tail_start = max(0, history.num_tokens - tail)
    return [s for s in history.segments if not is_sink(s, budget) and s.end <= tail_start]


def all_positions(history: SessionHistory) -> list[int]:
    return [history.position_of(i) for i in range(history.num_tokens)]


def chunk_window_history(num_chunks: int) -> tuple[RetentionBudget, SessionHistory]:
    """Sink: 1 chunk of 20 tokens; then ``num_chunks`` frame chunks of 24 tokens."""
    budget = RetentionBudget(sink_chunks=1, window_chunks=4)
    history = append_segment(SessionHistory.for_budget(budget), "chunk", 20)
    for _ in range(num_chunks):
        history = append_segment(history, "frame", 24)
    return budget, history


# --------------------------------------------------------------------------- exact plans


def test_ten_chunks_at_once_coalesce_into_one_aligned_range() -> None:
    # Block 16; sink = chunk 0 [0,20); chunk i (1..10) = [20+24(i-1), 20+24i); window 4 chunks,
    # low watermark floor(4*0.75) = 3, so 7 of the 10 go. Chunk 10 is the protected tail.
    # Chunks 1..7 span [20,188) as ONE run; rounded inward: [ceil(20/16)*16, floor(188/16)*16)
    # = [32,176). Chunk 1 keeps its head [20,32) (shares block 1 with the sink), chunk 7 its tail
    # [176,188); chunks 2..6 go entirely.
    budget, history = chunk_window_history(10)
    plan = plan_eviction(history, budget, 16, 24)
    assert plan == EvictionPlan(
        ranges=((32, 176),),
        dropped_segments=(1, 2, 3, 4, 5, 6, 7),
        evicted_segments=(2, 3, 4, 5, 6),
        remnant_segments=(1, 7),
        tokens_freed=144,
    )
    after = apply_eviction(history, plan.ranges, dropped=plan.dropped_segments)
    # Offsets compact by 144; remnants keep their original positions (chunk 7's tail: 176..).
    assert spans(after) == [
        (0, 0, 20, False),
        (1, 20, 32, True),
        (7, 32, 44, True),
        (8, 44, 68, False),
        (9, 68, 92, False),
        (10, 92, 116, False),
    ]
    assert [s.position_start for s in after.segments] == [0, 20, 176, 188, 212, 236]
    assert (after.tokens_evicted_total, after.chunks_evicted_total) == (144, 5)
    assert (after.evictions_total, after.num_chunks) == (1, 6)
    assert retained_chunks(after, budget) == 3
    assert after.next_position() == 260  # 20 + 10 * 24: positions are never reused


def test_chunk_window_evicts_in_batches_with_exact_ranges() -> None:
    # Same shapes, but evicting after every chunk with that chunk protected. Chunk 5 is the
    # first over the window (5 > 4): drop chunks 1,2 (5 -> 3), run [20,68) -> [32,64).
    # Then the state repeats every 2 chunks: sink, remnant of the oldest dropped chunk [20,32),
    # remnant tail [32,36), 3 full chunks; at the next overflow the run [20,84) -> [32,80).
    budget, history = chunk_window_history(0)
    events: list[tuple[int, tuple[tuple[int, int], ...]]] = []
    for chunk in range(1, 12):
        history = append_segment(history, "frame", 24)
        plan, history = evict(history, budget, 16, 24)
        if not plan.is_empty:
            events.append((chunk, plan.ranges))
    assert events == [
        (5, ((32, 64),)),
        (7, ((32, 80),)),
        (9, ((32, 80),)),
        (11, ((32, 80),)),
    ]
    # After chunk 11: chunk 1's head is stuck in the sink's block for good; chunk 8's tail
    # [80,84) is a remnant; chunks 9..11 are the window.
    assert spans(history) == [
        (0, 0, 20, False),
        (1, 20, 32, True),
        (8, 32, 36, True),
        (9, 36, 60, False),
        (10, 60, 84, False),
        (11, 84, 108, False),
    ]
    assert history.tokens_evicted_total == 32 + 3 * 48
    assert history.chunks_evicted_total == 6  # chunks 2..7 (1 and 8 still hold remnants)


def test_token_window_with_sink_tokens() -> None:
    # Block 8, sink_tokens 8, window 64 tokens -> low floor(64*0.75) = 48; chunks of 16 tokens,
    # the newest protected. After 5 chunks: 80 tokens, 72 retained > 64, so free >= 24:
    # chunk 0 straddles the sink boundary ([8,16) freeable: 64 left), chunk 1 too ([8,32): 48).
    budget = RetentionBudget(sink_tokens=8, window_tokens=64)
    history = SessionHistory.for_budget(budget)
    plans: list[tuple[int, EvictionPlan]] = []
    for chunk in range(9):
        history = append_segment(history, "text", 16)
        plan, history = evict(history, budget, 8, 16)
        if not plan.is_empty:
            plans.append((chunk, plan))
    first_chunk, first = plans[0]
    assert first_chunk == 4
    assert first.ranges == ((8, 32),)
    assert (first.dropped_segments, first.evicted_segments) == ((0, 1), (1,))
    assert first.remnant_segments == (0,)  # its head [0,8) is sink tokens, kept forever
    # Next overflow at chunk 6 (88 tokens, 80 retained): chunks 2,3 = [8,40) -> 32 freed.
    assert [(c, p.ranges) for c, p in plans] == [(4, ((8, 32),)), (6, ((8, 40),)), (8, ((8, 40),))]
    assert retained_tokens(history, budget) == 48
    assert spans(history)[0] == (0, 0, 8, True)


def test_no_eviction_until_high_watermark_then_down_to_low() -> None:
    # Block 1 (no alignment loss), window 8 chunks, ratio 0.5 -> low 4. The 9th chunk is the
    # first over the window and drops 5 (9 -> 4); then 5 more appends reach 9 again.
    budget = RetentionBudget(window_chunks=8, low_watermark_ratio=0.5)
    history = SessionHistory.for_budget(budget)
    evicted_at: list[int] = []
    for chunk in range(1, 25):
        history = append_segment(history, "text", 10)
        plan, history = evict(history, budget, 1, 10)
        if plan.ranges:
            evicted_at.append(chunk)
            assert plan.tokens_freed == 50
        assert retained_chunks(history, budget) <= 8
    assert evicted_at == [9, 14, 19, 24]
    assert retained_chunks(history, budget) == 4


def test_ratio_one_evicts_on_every_overflow() -> None:
    # low watermark = window: each chunk past the window pushes out exactly one.
    budget = RetentionBudget(window_chunks=3, low_watermark_ratio=1.0)
    history = SessionHistory.for_budget(budget)
    freed: list[int] = []
    for _ in range(6):
        history = append_segment(history, "text", 8)
        plan, history = evict(history, budget, 4, 8)
        freed.append(plan.tokens_freed)
    assert freed == [0, 0, 0, 8, 8, 8]


def test_either_window_triggers_and_both_must_be_met() -> None:
    # Window 10 chunks / 40 tokens (low: 7 chunks, 30 tokens). Chunks of 20 tokens: the token
    # window trips at the 3rd chunk (60 > 40); getting to <= 30 drops 2 (20 left), chunks fine.
    budget = RetentionBudget(window_chunks=10, window_tokens=40)
    history = SessionHistory.for_budget(budget)
    for _ in range(3):
        history = append_segment(history, "text", 20)
    plan = plan_eviction(history, budget, 1, 20)
    assert plan.ranges == ((0, 40),)


def test_pinned_segment_in_the_middle_splits_the_ranges() -> None:
    # Block 8; chunks [0,12) [12,24)=pinned [24,36) [36,48); window 1 chunk, ratio 1; nothing
    # protected. 3 unpinned > 1: drop chunks 0 and 2 (oldest first), never the pinned one.
    # Separate runs are aligned separately: [0,12) -> [0,8), [24,36) -> [24,32).
    budget = RetentionBudget(window_chunks=1, low_watermark_ratio=1.0)
    history = SessionHistory.for_budget(budget)
    for pinned in (False, True, False, False):
        history = append_segment(history, "text", 12, pinned=pinned)
    plan = plan_eviction(history, budget, 8, 0)
    assert plan.ranges == ((0, 8), (24, 32))
    assert (plan.dropped_segments, plan.remnant_segments) == ((0, 2), (0, 2))
    after = apply_eviction(history, plan.ranges, dropped=plan.dropped_segments)
    assert spans(after) == [
        (0, 0, 4, True),
        (1, 4, 16, False),
        (2, 16, 20, True),
        (3, 20, 32, False),
    ]


def test_coalescing_frees_blocks_that_per_segment_alignment_would_lose() -> None:
    # Block 16, three 10-token chunks [0,30): no chunk holds a whole block on its own, but the
    # coalesced run [0,30) holds block 0.
    budget = RetentionBudget(window_chunks=1, low_watermark_ratio=1.0)
    history = SessionHistory.for_budget(budget)
    for _ in range(4):
        history = append_segment(history, "reply", 10)
    plan = plan_eviction(history, budget, 16, 10)
    assert plan.ranges == ((0, 16),)
    assert plan.evicted_segments == (0,)
    assert plan.remnant_segments == (1, 2)


def test_protected_tail_and_sinks_leave_nothing_to_evict() -> None:
    budget = RetentionBudget(sink_chunks=1, window_chunks=1)
    history = SessionHistory.for_budget(budget)
    for _ in range(4):
        history = append_segment(history, "text", 32)
    plan = plan_eviction(history, budget, 16, history.num_tokens)  # everything in flight
    assert plan.is_empty
    assert plan == EvictionPlan()
    # Over the window, but the only candidates sit in blocks shared with sink / tail: dropped,
    # nothing freed; apply marks them remnants so they do not count as window chunks again.
    history = SessionHistory.for_budget(budget)
    for n in (20, 4, 40):
        history = append_segment(history, "text", n)
    plan = plan_eviction(history, budget, 16, 40)
    assert plan.ranges == ()
    assert plan.dropped_segments == (1,)
    after = apply_eviction(history, plan.ranges, dropped=plan.dropped_segments)
    assert spans(after) == [(0, 0, 20, False), (1, 20, 24, True), (2, 24, 64, False)]
    assert after.evictions_total == 0


def test_one_big_chunk_leaves_a_head_and_a_tail_remnant() -> None:
    # Block 16; sink chunk [0,20); a 100-token video [20,120); text [120,130) protected.
    # Rounding [20,120) inward gives [32,112): the video keeps [20,32) and [112,120), two
    # remnant pieces with the same index (positions 20.. and 112..).
    budget = RetentionBudget(sink_chunks=1, window_chunks=1, low_watermark_ratio=1.0)
    history = SessionHistory.for_budget(budget)
    history = append_segment(history, "chunk", 20)
    history = append_segment(history, "frame", 100)
    history = append_segment(history, "text", 10)
    plan, history = evict(history, budget, 16, 10)
    assert plan.ranges == ((32, 112),)
    assert spans(history) == [
        (0, 0, 20, False),
        (1, 20, 32, True),
        (1, 32, 40, True),
        (2, 40, 50, False),
    ]
    assert [s.position_start for s in history.segments] == [0, 20, 112, 120]
    assert history.chunks_evicted_total == 0  # chunk 1 still holds tokens
    # Next batch: remnants first, then chunk 2: run [20,50) -> [32,48); chunk 1's tail piece
    # goes, its head stays stuck in the sink's block; chunk 2 keeps [48,50).
    history = append_segment(history, "text", 10)
    plan, history = evict(history, budget, 16, 10)
    assert plan.ranges == ((32, 48),)
    assert (plan.dropped_segments, plan.remnant_segments) == ((1, 2), (1, 2))
    assert spans(history) == [
        (0, 0, 20, False),
        (1, 20, 32, True),
        (2, 32, 34, True),
        (3, 34, 44, False),
    ]


# --------------------------------------------------------------------------- apply_eviction


def test_apply_when_the_kv_layer_frees_less() -> None:
    # Plan [32,176) of the 10-chunk example; the KV layer only freed [32,96): chunks 2,3 go,
    # chunk 4 [92,116) loses [92,96), chunks 5..7 were dropped but not freed (remnants, tried
    # again with the next batch).
    budget, history = chunk_window_history(10)
    plan = plan_eviction(history, budget, 16, 24)
    after = apply_eviction(history, [(32, 96), (176, 176)], dropped=plan.dropped_segments)
    assert spans(after) == [
        (0, 0, 20, False),
        (1, 20, 32, True),
        (4, 32, 52, True),
        (5, 52, 76, True),
        (6, 76, 100, True),
        (7, 100, 124, True),
        (8, 124, 148, False),
        (9, 148, 172, False),
        (10, 172, 196, False),
    ]
    assert after.segments[2].position_start == 96
    assert (after.tokens_evicted_total, after.chunks_evicted_total) == (64, 2)
    assert retained_chunks(after, budget) == 3
    # Without `dropped`, untouched chunks stay full window chunks.
    plain = apply_eviction(history, [(32, 96)])
    assert [s.remnant for s in plain.segments].count(True) == 2
    # Nothing freed and nothing dropped: nothing changes.
    same = apply_eviction(history, [])
    assert same == history


@pytest.mark.parametrize(
    ("freed", "message"),
    [
        ([(10, 30)], "pinned"),  # chunk 0 [0,20) is the sink
        ([(64, 96), (32, 64)], "overlaps or precedes"),
        ([(32, 80), (64, 96)], "overlaps or precedes"),
        ([(32, 1000)], "outside"),
        ([(-16, 0)], "outside"),
        ([(40, 32)], "outside"),
    ],
)
def test_apply_refuses_bad_ranges(freed: list[tuple[int, int]], message: str) -> None:
    _, history = chunk_window_history(10)
    with pytest.raises(ValueError, match=message):
        apply_eviction(history, freed)


def test_apply_refuses_dropping_a_pinned_chunk() -> None:
    _, history = chunk_window_history(2)
    with pytest.raises(ValueError, match="pinned"):
        apply_eviction(history, [], dropped=[0])


# --------------------------------------------------------------------------- positions


def test_positions_consolidation_and_limit() -> None:
    budget, history = chunk_window_history(10)
    budget = RetentionBudget(sink_chunks=1, window_chunks=4, max_position=300)
    _, after = evict(history, budget, 16, 24)
    assert after.position_of(0) == 0
    assert after.position_of(31) == 31  # chunk 1's head
    assert after.position_of(32) == 176  # chunk 7's tail: a gap of 144 before it
    assert after.position_of(115) == 259
    assert after.segment_at(32).index == 7
    with pytest.raises(IndexError):
        after.position_of(116)
    # Next position 260; positions must stay < 300, so 40 more tokens fit, 41 do not.
    assert not needs_consolidation(after, budget, 40)
    assert needs_consolidation(after, budget, 41)
    assert needs_consolidation(after, budget, 1, max_position=260)
    unlimited = RetentionBudget(window_chunks=4)
    assert not needs_consolidation(after, unlimited, 10**9)
    squashed = consolidate(after)
    assert all_positions(squashed) == list(range(116))
    assert squashed.next_position() == 116
    assert squashed.consolidations_total == 1
    assert not needs_consolidation(squashed, budget, 41)
    with pytest.raises(ValueError, match="incoming_tokens"):
        needs_consolidation(after, budget, -1)


def test_append_continues_positions_and_pins_sink_chunks() -> None:
    budget = RetentionBudget(sink_chunks=2, window_chunks=2)
    history = SessionHistory.for_budget(budget)
    for n in (5, 6, 7):
        history = append_segment(history, "text", n)
    history = append_segment(history, "frame", 3, pinned=True)
    assert [s.pinned for s in history.segments] == [True, True, False, True]
    assert [s.position_start for s in history.segments] == [0, 5, 11, 18]
    assert (history.num_tokens, history.next_index, history.next_position()) == (21, 4, 21)
    for bad in (0, -1, True):
        with pytest.raises(ValueError, match="num_tokens"):
            append_segment(history, "text", bad)
    for kind in ("", "image"):  # only the kinds the adapter records
        with pytest.raises(ValueError, match="kind"):
            append_segment(history, kind, 3)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- budget


def test_budget_from_request_args() -> None:
    args = {
        "sink_tokens": 4,
        "sink_chunks": 1,
        "window_chunks": 8,
        "window_tokens": None,
        "low_watermark_ratio": 1,
        "max_position": 4096,
    }
    budget = RetentionBudget.from_request_args(args)
    assert budget == RetentionBudget(
        sink_tokens=4, sink_chunks=1, window_chunks=8, low_watermark_ratio=1.0, max_position=4096
    )
    assert (budget.low_watermark_chunks, budget.low_watermark_tokens) == (8, None)
    assert RetentionBudget.from_request_args({"window_tokens": 100}).low_watermark_tokens == 75


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"window_chunks": 4, "window": 3}, "unknown key 'window'"),
        ({"window_chunks": "4"}, r"streaming_retention\.window_chunks must be an integer"),
        ({"window_chunks": 4.0}, r"window_chunks must be an integer or null"),
        ({"window_chunks": True}, r"window_chunks must be an integer"),
        ({"window_chunks": 4, "sink_tokens": None}, r"sink_tokens must be an integer"),
        ({"window_chunks": 4, "low_watermark_ratio": "x"}, "low_watermark_ratio must be a number"),
        ({"window_chunks": 4, "low_watermark_ratio": False}, "low_watermark_ratio"),
        ({"window_chunks": 0}, "window_chunks must be an integer >= 1"),
        ({"sink_chunks": 1}, "needs window_chunks or window_tokens"),
        ({"window_chunks": 4, "sink_chunks": -1}, "sink_chunks must be an integer >= 0"),
        ({"window_chunks": 4, "low_watermark_ratio": 0}, r"low_watermark_ratio must be in"),
        ({"window_tokens": 100, "max_position": 50}, "max_position 50 leaves no room"),
    ],
)
def test_request_args_refused_with_the_key_named(args: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        RetentionBudget.from_request_args(args)
    assert str(info.value).startswith(REQUEST_ARGS_KEY)


def test_request_args_must_be_a_mapping() -> None:
    with pytest.raises(ValueError, match="must be a mapping"):
        RetentionBudget.from_request_args([("window_chunks", 4)])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window_chunks": 4, "low_watermark_ratio": 1.5},
        {"window_chunks": 4, "low_watermark_ratio": float("nan")},
        {"window_chunks": 4, "low_watermark_ratio": -0.5},
        {"window_tokens": 0},
        {"window_chunks": 4, "max_position": 0},
        {"window_chunks": 4, "sink_tokens": -3},
        {},
    ],
)
def test_budget_validate_refuses_nonsense(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        RetentionBudget(**kwargs)  # type: ignore[arg-type]


def test_low_watermarks_round_down_but_keep_one() -> None:
    # floor(w * ratio) with the ratio taken as written (0.57 * 100 is 56.99999 in floats).
    assert RetentionBudget(window_tokens=100, low_watermark_ratio=0.57).low_watermark_tokens == 57
    assert RetentionBudget(window_chunks=10, low_watermark_ratio=0.7).low_watermark_chunks == 7
    assert RetentionBudget(window_chunks=1, low_watermark_ratio=0.5).low_watermark_chunks == 1


def test_plan_refuses_bad_arguments() -> None:
    budget, history = chunk_window_history(3)
    with pytest.raises(ValueError, match="block_size"):
        plan_eviction(history, budget, 0, 0)
    with pytest.raises(ValueError, match="protected_tail_tokens"):
        plan_eviction(history, budget, 16, -1)


# --------------------------------------------------------------------------- invariants


def seg(index: int, start: int, end: int, pos: int, **kw: bool) -> HistorySegment:
    return HistorySegment(index=index, kind="text", start=start, end=end, position_start=pos, **kw)


@pytest.mark.parametrize(
    ("segments", "message"),
    [
        ((seg(0, 1, 5, 0),), "expected 0"),
        ((seg(0, 0, 5, 0), seg(1, 6, 8, 5)), "expected 5"),
        ((seg(1, 0, 5, 0), seg(0, 5, 8, 5)), "out of order"),
        ((seg(0, 0, 5, 0), seg(0, 5, 8, 5)), "out of order"),
        ((seg(0, 0, 5, 10), seg(1, 5, 8, 12)), "overlaps"),
        ((seg(0, 0, 5, 0), seg(5, 5, 8, 5)), "next_index"),
    ],
)
def test_history_invariant_is_checked(segments: tuple[HistorySegment, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SessionHistory(segments=segments, next_index=5, position_cursor=100)


def test_segment_and_cursor_checks() -> None:
    with pytest.raises(ValueError, match="start < end"):
        seg(0, 3, 3, 0)
    with pytest.raises(ValueError, match="pinned segment cannot be a remnant"):
        seg(0, 0, 3, 0, pinned=True, remnant=True)
    with pytest.raises(ValueError, match="position_cursor"):
        SessionHistory(segments=(seg(0, 0, 5, 0),), next_index=1, position_cursor=4)
    ok = SessionHistory(
        segments=(seg(0, 0, 5, 0, remnant=True), seg(0, 5, 8, 9, remnant=True)),
        next_index=1,
        position_cursor=12,
    )
    assert ok.num_chunks == 1


# --------------------------------------------------------------------------- properties


def check_plan(sc: Scenario, plan: EvictionPlan) -> None:
    history, budget, bs = sc.history, sc.budget, sc.block_size
    tail_start = max(0, history.num_tokens - sc.protected_tail_tokens)
    prev_end = -1
    for start, end in plan.ranges:
        assert start % bs == 0 and end % bs == 0, "block-aligned"
        assert prev_end < start < end, "sorted, disjoint, non-empty"  # < : runs never touch
        assert budget.sink_tokens <= start and end <= tail_start
        for s in history.segments:
            if is_sink(s, budget):
                assert end <= s.start or s.end <= start, "never touches a sink"
        prev_end = end
    assert plan.tokens_freed == sum(b - a for a, b in plan.ranges)
    cands = candidates(history, budget, sc.protected_tail_tokens)
    dropped = list(plan.dropped_segments)
    assert dropped == list(dict.fromkeys(s.index for s in cands))[: len(dropped)], "oldest first"
    assert set(plan.evicted_segments) | set(plan.remnant_segments) == set(dropped)
    assert not set(plan.evicted_segments) & set(plan.remnant_segments)


def triggered(history: SessionHistory, budget: RetentionBudget) -> bool:
    t, c = retained_tokens(history, budget), retained_chunks(history, budget)
    return (budget.window_tokens is not None and t > budget.window_tokens) or (
        budget.window_chunks is not None and c > budget.window_chunks
    )


@settings(max_examples=100, deadline=None)
@given(scenarios())
def test_plan_ranges_are_aligned_disjoint_and_avoid_sinks_and_tail(sc: Scenario) -> None:
    plan = plan_eviction(sc.history, sc.budget, sc.block_size, sc.protected_tail_tokens)
    check_plan(sc, plan)
    if not triggered(sc.history, sc.budget):
        assert plan.is_empty


@settings(max_examples=100, deadline=None)
@given(scenarios())
def test_apply_reaches_the_watermarks_and_keeps_survivors_positions(sc: Scenario) -> None:
    history, budget = sc.history, sc.budget
    plan = plan_eviction(history, budget, sc.block_size, sc.protected_tail_tokens)
    after = apply_eviction(history, plan.ranges, dropped=plan.dropped_segments)
    cands = candidates(history, budget, sc.protected_tail_tokens)
    all_dropped = len(plan.dropped_segments) == len({s.index for s in cands})
    if not triggered(history, budget):
        assert after == history
    elif not all_dropped:  # enough evictable blocks: down to the low watermarks
        low_t, low_c = budget.low_watermark_tokens, budget.low_watermark_chunks
        assert low_t is None or retained_tokens(after, budget) <= low_t
        assert low_c is None or retained_chunks(after, budget) <= low_c
    # Offsets contiguous (also checked by SessionHistory itself).
    ends = [0, *(s.end for s in after.segments)]
    assert [s.start for s in after.segments] == ends[:-1]
    # Every surviving token keeps its position; positions strictly increase.
    survivors = [
        history.position_of(i)
        for i in range(history.num_tokens)
        if not any(a <= i < b for a, b in plan.ranges)
    ]
    positions = all_positions(after)
    assert positions == survivors
    assert all(p < q for p, q in itertools.pairwise(positions))
    assert all(p < after.next_position() for p in positions)
    assert after.num_tokens == history.num_tokens - plan.tokens_freed
    assert after.tokens_evicted_total == history.tokens_evicted_total + plan.tokens_freed
    gone = {s.index for s in history.segments} - {s.index for s in after.segments}
    assert gone == set(plan.evicted_segments)
    assert after.chunks_evicted_total == history.chunks_evicted_total + len(gone)


@settings(max_examples=100, deadline=None)
@given(scenarios(), st.data())
def test_partial_frees_keep_the_invariant(sc: Scenario, data: st.DataObject) -> None:
    # The KV layer may free any block-aligned part of the plan (or nothing): the history stays
    # valid (SessionHistory checks its invariant), sinks are intact, positions increase.
    plan = plan_eviction(sc.history, sc.budget, sc.block_size, sc.protected_tail_tokens)
    freed = data.draw(partial_frees(plan.ranges, sc.block_size))
    after = apply_eviction(sc.history, freed, dropped=plan.dropped_segments)
    width = sum(b - a for a, b in freed)
    assert after.num_tokens == sc.history.num_tokens - width
    assert after.tokens_evicted_total == sc.history.tokens_evicted_total + width

    def pinned(h: SessionHistory) -> list[tuple[int, int, int]]:
        return [(s.index, s.num_tokens, s.position_start) for s in h.segments if s.pinned]

    assert pinned(after) == pinned(sc.history)
    positions = all_positions(after)
    assert all(p < q for p, q in itertools.pairwise(positions))
    dropped = set(plan.dropped_segments)
    assert all(s.remnant for s in after.segments if s.index in dropped)


@settings(max_examples=100, deadline=None)
@given(scenarios())
def test_consolidation_numbers_positions_from_zero(sc: Scenario) -> None:
    squashed = consolidate(sc.history)
    assert all_positions(squashed) == list(range(sc.history.num_tokens))
    assert squashed.next_position() == sc.history.num_tokens
    assert spans(squashed) == spans(sc.history)


@settings(max_examples=100, deadline=None)
@given(scenarios())
def test_rotation_runs_move_every_token_to_where_a_consolidation_puts_it(sc: Scenario) -> None:
    runs = rotation_runs(sc.history)
    positions = all_positions(sc.history)
    for a, b, delta in runs:
        assert delta != 0
        for i in range(a, b):
            positions[i] += delta
    assert positions == all_positions(consolidate(sc.history))
    assert all(b1 <= a2 for (_, b1, _), (a2, _, _) in itertools.pairwise(runs))
    # Adjacent runs are merged when they move by the same amount.
    assert all(b1 < a2 or d1 != d2 for (_, b1, d1), (a2, _, d2) in itertools.pairwise(runs))


def test_a_budget_names_a_consolidation_mode_or_leaves_it_to_the_engine() -> None:
    args = {"window_chunks": 4}
    assert RetentionBudget.from_request_args(args).consolidation is None
    budget = RetentionBudget.from_request_args({**args, "consolidation": "reprefill"})
    assert budget.consolidation == "reprefill"
    with pytest.raises(ValueError, match="consolidation must be one of rotate, reprefill"):
        RetentionBudget.from_request_args({**args, "consolidation": "shift"})
    with pytest.raises(ValueError, match="consolidation must be a string"):
        RetentionBudget.from_request_args({**args, "consolidation": 1})


@settings(max_examples=100, deadline=None)
@given(
    budgets(max_window_chunks=6, max_window_tokens=300),
    st.sampled_from([1, 4, 16, 32]),
    st.integers(0, 2**32 - 1),
)
def test_long_runs_stay_bounded(budget: RetentionBudget, block_size: int, seed: int) -> None:
    # 400 chunks (200 inputs, each followed by its reply), eviction after every input with the
    # input protected, consolidation whenever a position limit of 2048 would be reached.
    # Bounds on retained tokens right after an input's eviction: a token window holds at most
    # the window (not triggered) or the low mark, or, when everything evictable went, the
    # input alone; a chunk window holds at most window_chunks chunks. Remnants add < 2 blocks
    # (< 1 stuck after the sinks, < 1 at the edge of the last run). The reply adds its size.
    max_chunk, max_reply, limit = 60, 30, 2048
    bounds: list[int] = []
    if budget.window_tokens is not None:
        bounds.append(max(budget.window_tokens, max_chunk) + 2 * block_size)
    if budget.window_chunks is not None:
        bounds.append(budget.window_chunks * max_chunk + 2 * block_size)
    bound = min(bounds) + max_reply
    rnd = random.Random(seed)  # chunk sizes (a seed: drawing 400 sizes via hypothesis is slow)
    history = SessionHistory.for_budget(budget)
    sink_total = 0
    for _ in range(200):
        for kind, most in (("frame", max_chunk), ("reply", max_reply)):
            n = rnd.randint(1, most)
            if needs_consolidation(history, budget, n, limit):
                history = consolidate(history)
            history = append_segment(history, kind, n)
            if history.segments[-1].pinned:
                sink_total += n
            if kind == "frame":
                _, history = evict(history, budget, block_size, n)
        assert retained_tokens(history, budget) <= bound
        assert history.num_tokens <= sink_total + budget.sink_tokens + bound
        assert history.next_position() <= limit
    assert history.next_index == 400
