"""Pure logic of idle consolidation and of re-prefill step sizes (retention/policy.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from retention.policy import (
    RetentionBudget,
    SessionHistory,
    append_segment,
    idle_consolidation_due,
    needs_consolidation,
    reprefill_piece,
    reprefill_pieces,
)

# Needs no model runner: `make compat` also runs it against every supported vLLM.
pytestmark = pytest.mark.compat

POWERS = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def allowed_sizes(piece: int) -> set[int]:
    """The piece, its 7 grain multiples below it, and the sizes under one grain."""
    grain = max(1, piece // 8)
    return {piece} | {grain * k for k in range(1, 8)} | set(range(1, grain))


def test_reprefill_pieces_examples() -> None:
    assert reprefill_pieces(300, 128) == [128, 128, 32, 12]
    assert reprefill_pieces(250, 128) == [128, 112, 10]
    assert reprefill_pieces(128, 128) == [128]
    assert reprefill_pieces(7, 128) == [7]
    assert reprefill_pieces(7, 4) == [4, 3]
    assert reprefill_pieces(300, 0) == [300]
    assert reprefill_pieces(0, 64) == []


@pytest.mark.parametrize("remaining, piece", [(0, 64), (-3, 64), (10, 48), (10, -1)])
def test_reprefill_piece_refuses_bad_arguments(remaining: int, piece: int) -> None:
    with pytest.raises(ValueError):
        reprefill_piece(remaining, piece)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000), st.sampled_from(POWERS))
def test_reprefill_pieces_cover_the_total_in_few_repeating_sizes(total: int, piece: int) -> None:
    steps = reprefill_pieces(total, piece)
    assert sum(steps) == total
    assert all(s >= 1 for s in steps)
    if piece == 0:
        assert steps == [total]
        return
    assert set(steps) <= allowed_sizes(piece)
    # Whole pieces first, then the rest's whole grains, then what is left: two steps at most.
    whole = total // piece
    assert steps[:whole] == [piece] * whole
    rest = steps[whole:]
    assert rest == sorted(rest, reverse=True) and len(set(rest)) == len(rest) <= 2


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5000), st.sampled_from(POWERS[1:]), st.integers(1, 5000))
def test_every_step_is_the_piece_of_what_is_left(total: int, piece: int, cap: int) -> None:
    """A step that vLLM cuts shorter (token budget, encoder budget) is followed by steps that
    still come from the same small set of sizes."""
    left = total
    sizes: set[int] = set()
    while left:
        step = min(reprefill_piece(left, piece), cap)
        sizes.add(step)
        left -= step
    if cap >= piece:
        assert sizes <= allowed_sizes(piece)


def test_idle_consolidation_due_examples() -> None:
    assert not idle_consolidation_due(100, 40, None)
    assert not idle_consolidation_due(100, 0, 120)  # nothing seen yet
    assert not idle_consolidation_due(80, 40, 120)  # reaches 120 exactly: still fits
    assert idle_consolidation_due(81, 40, 120)
    with pytest.raises(ValueError):
        idle_consolidation_due(-1, 4, 10)
    with pytest.raises(ValueError):
        idle_consolidation_due(1, True, 10)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(1, 80), min_size=1, max_size=30),
    st.integers(1, 80),
    st.integers(1, 4000),
)
def test_idle_consolidation_due_iff_the_next_fold_would_consolidate(
    chunks: list[int], incoming: int, limit: int
) -> None:
    """At a chunk boundary the answered chunk is not a segment yet; the next fold records it
    and asks needs_consolidation for the next chunk: the idle check must give the same answer
    from the cursor alone (eviction never moves the cursor)."""
    budget = RetentionBudget(sink_chunks=1, window_chunks=4)
    history = SessionHistory.for_budget(budget)
    for n in chunks[:-1]:
        history = append_segment(history, "text", n)
    cursor_at_boundary = history.next_position() + chunks[-1]
    at_next_fold = append_segment(history, "text", chunks[-1])
    assert idle_consolidation_due(cursor_at_boundary, incoming, limit) == needs_consolidation(
        at_next_fold, budget, incoming, limit
    )


def test_idle_consolidation_only_where_the_client_leaves_time_for_it() -> None:
    from retention.policy import idle_time_suffices

    assert idle_time_suffices([], None)  # nothing measured yet: try it
    assert idle_time_suffices([0.05], None)
    assert idle_time_suffices([], 0.3)
    assert idle_time_suffices([0.3, 0.4, 0.05], 0.3)  # median 0.3
    assert not idle_time_suffices([0.06, 0.05, 0.4], 0.3)  # a busy client: median 0.06
    with pytest.raises(ValueError):
        idle_time_suffices([-1.0], 0.3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0, 10), min_size=1, max_size=8), st.floats(0, 10))
def test_idle_consolidation_decision_is_monotone(gaps: list[float], took: float) -> None:
    from retention.policy import idle_time_suffices

    if idle_time_suffices(gaps, took):
        # Longer gaps or a faster consolidation never turn a yes into a no.
        assert idle_time_suffices([g + 1 for g in gaps], took)
        assert idle_time_suffices(gaps, took / 2)
