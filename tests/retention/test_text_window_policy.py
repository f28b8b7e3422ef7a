"""Two budgets (`text_window_tokens`): frames leave by the frame window, text by its own."""

from __future__ import annotations

import pytest

from retention.policy import (
    RetentionBudget,
    SessionHistory,
    append_segment,
    apply_eviction,
    eviction_rounds,
    plan_eviction,
)

# Needs no model runner: `make compat` also runs it against every supported vLLM.
pytestmark = pytest.mark.compat


def run_rounds(history: SessionHistory, budget: RetentionBudget, bs: int) -> SessionHistory:
    for plan_round in eviction_rounds(budget):
        plan = plan_round(history, budget, bs, 0)
        history = apply_eviction(history, plan.ranges, dropped=plan.dropped_segments)
    return history


def kinds(history: SessionHistory) -> list[str]:
    return [s.kind for s in history.segments if not s.remnant]


def test_without_a_text_window_one_round() -> None:
    assert eviction_rounds(RetentionBudget(window_chunks=2)) == (plan_eviction,)


def test_text_outlives_frames() -> None:
    budget = RetentionBudget(sink_chunks=0, window_chunks=2, text_window_tokens=40)
    h = SessionHistory.for_budget(budget)
    h = append_segment(h, "text", 8)  # a question ...
    h = append_segment(h, "reply", 8)  # ... and its reply: 16 text tokens
    for _ in range(10):
        h = append_segment(h, "frame", 16)  # block-sized frames: exact eviction
        h = run_rounds(h, budget, 16)
    assert kinds(h) == ["text", "reply", "frame", "frame"]
    assert not any(s.remnant for s in h.segments)
    # More text than the text window: the oldest text leaves, the frames stay.
    for _ in range(3):
        h = append_segment(h, "text", 16)
        h = run_rounds(h, budget, 16)
    assert kinds(h) == ["frame", "frame", "text", "text"]


def test_frames_around_kept_text_leave_remnants_charged_to_text() -> None:
    budget = RetentionBudget(sink_chunks=0, window_chunks=1, text_window_tokens=1000)
    h = SessionHistory.for_budget(budget)
    h = append_segment(h, "frame", 20)
    h = append_segment(h, "text", 4)
    h = append_segment(h, "frame", 20)
    h = append_segment(h, "frame", 20)
    h = run_rounds(h, budget, 16)
    # Two frames dropped, [0, 20) and [24, 44): only the block [0, 16) is whole; the rest
    # shares blocks with the kept text and frame and stays as remnants (4 + 20 tokens), which
    # the text budget counts.
    assert kinds(h) == ["text", "frame"]
    assert h.num_tokens == 64 - 16
    assert sum(s.num_tokens for s in h.segments if s.remnant) == 4 + 20


def test_text_window_validated() -> None:
    with pytest.raises(ValueError, match="text_window_tokens"):
        RetentionBudget(window_chunks=1, text_window_tokens=0)
    parsed = RetentionBudget.from_request_args({"window_chunks": 2, "text_window_tokens": 64})
    assert parsed.text_window_tokens == 64


def test_remnants_go_before_an_older_question() -> None:
    # A question, then frames whose eviction leaves remnants (they share blocks with the kept
    # reply and with each other): the remnants are charged to the text budget, and must be the
    # first to go, not the older question.
    budget = RetentionBudget(sink_chunks=0, window_chunks=1, text_window_tokens=30)
    h = SessionHistory.for_budget(budget)
    h = append_segment(h, "text", 10)
    h = append_segment(h, "reply", 4)
    for _ in range(6):
        h = append_segment(h, "frame", 20)
        h = run_rounds(h, budget, 16)
    assert kinds(h)[:2] == ["text", "reply"], [(s.kind, s.remnant) for s in h.segments]
