"""Hypothesis strategies shared by the tests (retention policy: budgets, chunks, histories)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import get_args

from hypothesis import strategies as st

from retention.policy import (
    RetentionBudget,
    SegmentKind,
    SessionHistory,
    append_segment,
    apply_eviction,
    consolidate,
    plan_eviction,
)

# --------------------------------------------------------------------------- retention policy

block_sizes = st.sampled_from([1, 2, 4, 8, 16, 32])
"""KV block sizes (tokens per block); 1 means no alignment loss."""

segment_kinds: st.SearchStrategy[SegmentKind] = st.sampled_from(get_args(SegmentKind))

low_watermark_ratios = st.sampled_from([0.25, 0.5, 0.75, 0.9, 1.0]) | st.floats(
    min_value=0.01, max_value=1.0
)


@st.composite
def budgets(
    draw: st.DrawFn, *, max_window_chunks: int = 8, max_window_tokens: int = 512
) -> RetentionBudget:
    """A valid budget: sinks (tokens and/or chunks) and at least one window."""
    window_chunks = draw(st.none() | st.integers(1, max_window_chunks))
    window_tokens_st = st.integers(1, max_window_tokens)
    if window_chunks is not None:
        window_tokens = draw(st.none() | window_tokens_st)
    else:
        window_tokens = draw(window_tokens_st)
    return RetentionBudget(
        sink_tokens=draw(st.integers(0, 64)),
        sink_chunks=draw(st.integers(0, 3)),
        window_chunks=window_chunks,
        window_tokens=window_tokens,
        low_watermark_ratio=draw(low_watermark_ratios),
    )


@dataclass(frozen=True)
class Chunk:
    """Arguments of one ``append_segment`` call."""

    kind: SegmentKind
    num_tokens: int
    pinned: bool


def chunks(*, max_tokens: int = 80, pin_probability_one_in: int = 10) -> st.SearchStrategy[Chunk]:
    """A chunk to fold in; pinned (beyond the sink chunks) about once in ``pin_..._in``."""
    return st.builds(
        Chunk,
        kind=segment_kinds,
        num_tokens=st.integers(1, max_tokens),
        pinned=st.integers(1, pin_probability_one_in).map(lambda x: x == 1),
    )


def partial_free(
    ranges: tuple[tuple[int, int], ...], block_size: int, rnd: random.Random
) -> list[tuple[int, int]]:
    """What a KV layer that frees less than planned may report: per range all, none (as an
    empty ``(s, s)`` range or left out), or a block-aligned prefix or suffix of it."""
    out: list[tuple[int, int]] = []
    for start, end in ranges:
        blocks = (end - start) // block_size
        choice = rnd.randrange(4)
        if choice == 0:
            out.append((start, end))
        elif choice == 1:
            if rnd.random() < 0.5:
                out.append((start, start))
        elif choice == 2:
            out.append((start, start + rnd.randint(0, blocks) * block_size))
        else:
            out.append((end - rnd.randint(0, blocks) * block_size, end))
    return out


def partial_frees(
    ranges: tuple[tuple[int, int], ...], block_size: int
) -> st.SearchStrategy[list[tuple[int, int]]]:
    return st.randoms(use_true_random=False).map(lambda rnd: partial_free(ranges, block_size, rnd))


@dataclass(frozen=True)
class Scenario:
    """A history reached by random appends, (partial) evictions and consolidations."""

    budget: RetentionBudget
    block_size: int
    history: SessionHistory
    protected_tail_tokens: int


_FRACTION = 1 << 16

# One step: fold a chunk in; then maybe evict (protecting a fraction of the cache; the KV layer
# frees all, or a random part, of the plan); then maybe consolidate.
_steps = st.tuples(
    chunks(),
    st.sampled_from(["keep", "keep", "evict", "evict-partially"]),
    st.integers(0, _FRACTION),
    st.integers(0, 2**32 - 1),
    st.integers(0, 19).map(lambda x: x == 0),
)


@st.composite
def scenarios(draw: st.DrawFn, *, max_steps: int = 30) -> Scenario:
    budget = draw(budgets(max_window_chunks=6, max_window_tokens=256))
    block_size = draw(block_sizes)
    history = SessionHistory.for_budget(budget)
    for chunk, action, tail_fraction, seed, squash in draw(
        st.lists(_steps, min_size=6, max_size=max_steps)
    ):
        history = append_segment(history, chunk.kind, chunk.num_tokens, pinned=chunk.pinned)
        if action != "keep":
            tail = history.num_tokens * tail_fraction // _FRACTION
            plan = plan_eviction(history, budget, block_size, tail)
            freed = list(plan.ranges)
            if action == "evict-partially":
                freed = partial_free(plan.ranges, block_size, random.Random(seed))
            history = apply_eviction(history, freed, dropped=plan.dropped_segments)
        if squash:
            history = consolidate(history)
    tail = draw(st.integers(0, _FRACTION)) * (history.num_tokens + 8) // _FRACTION
    return Scenario(budget, block_size, history, tail)
