"""The admission footprint is an upper bound on what a bounded session holds (pure, no engine).

The simulation does what the engine does at each fold (retention/vllm_adapter/eviction.py):
record the previous chunk and its kept reply as a segment, plan and apply the eviction (the
KV layer frees exactly the inward-rounded plan), consolidate when positions would pass the
limit; then the chunk is prefilled and answered. The peak blocks held at any point never
exceed `bounded_footprint(...).blocks`.
"""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from realtime.admission import (
    ChunkBounds,
    blocks_for,
    bounded_footprint,
    budget_problem,
    max_image_tokens,
    media_bounds,
)
from retention.policy import (
    RetentionBudget,
    SessionHistory,
    append_segment,
    apply_eviction,
    consolidate,
    needs_consolidation,
    plan_eviction,
)


@st.composite
def scenarios(
    draw: st.DrawFn,
) -> tuple[dict[str, int | float | None], ChunkBounds, int, list[tuple[int, int]]]:
    block_size = draw(st.sampled_from([16, 32, 128]))
    chunk_cap = draw(st.integers(1, 300))
    reply_cap = draw(st.integers(1, 64))
    instructions = draw(st.integers(0, 200))
    budget: dict[str, int | float | None] = {
        "sink_chunks": draw(st.integers(0, 2)),
        "sink_tokens": draw(st.integers(0, 100)),
        "window_chunks": draw(st.none() | st.integers(1, 8)),
        "window_tokens": None,
        "low_watermark_ratio": draw(st.sampled_from([0.25, 0.5, 0.75, 1.0])),
    }
    if budget["window_chunks"] is None or draw(st.booleans()):
        budget["window_tokens"] = draw(st.integers(1, 1000))
    chunks = draw(
        st.lists(
            # Mostly at the caps: the worst case is what admission must cover.
            st.tuples(
                st.just(chunk_cap) | st.integers(1, chunk_cap),
                st.just(reply_cap) | st.integers(1, reply_cap),
            ),
            min_size=1,
            max_size=60,
        )
    )
    return budget, ChunkBounds(chunk_cap, reply_cap, instructions), block_size, chunks


def simulate_peak(
    budget_args: dict[str, int | float | None],
    bounds: ChunkBounds,
    block_size: int,
    chunks: list[tuple[int, int]],
    max_position: int,
) -> int:
    budget = RetentionBudget(**{k: v for k, v in budget_args.items() if v is not None})  # type: ignore[arg-type]
    history = SessionHistory.for_budget(budget)
    held = 0  # tokens computed (the history plus the last chunk and its kept reply)
    peak = 0
    for i, (chunk, reply) in enumerate(chunks):
        if i == 0:
            chunk += bounds.instructions_tokens
        # The fold: what was computed since the last fold becomes a segment.
        if held > history.num_tokens:
            history = append_segment(history, "chunk", held - history.num_tokens)
        plan = plan_eviction(history, budget, block_size, protected_tail_tokens=0)
        if plan.ranges or plan.dropped_segments:
            history = apply_eviction(history, plan.ranges, dropped=plan.dropped_segments)
        if needs_consolidation(history, budget, chunk + reply, max_position):
            history = consolidate(history)
        # Prefill the chunk and decode the reply: all of it holds a slot at the end.
        peak = max(peak, history.num_tokens + chunk + reply)
        held = history.num_tokens + chunk + reply - 1  # the last sampled token is not kept
    return blocks_for(peak, block_size)


@settings(max_examples=1500, deadline=None)
@given(scenarios())
def test_reservation_bounds_the_peak(
    scenario: tuple[dict[str, int | float | None], ChunkBounds, int, list[tuple[int, int]]],
) -> None:
    budget, bounds, block_size, chunks = scenario
    footprint = bounded_footprint(budget, bounds, block_size)
    peak = simulate_peak(budget, bounds, block_size, chunks, max_position=10**9)
    assert peak <= footprint.blocks, (peak, footprint)


def test_footprint_parts_and_refusal_name_the_numbers() -> None:
    bounds = ChunkBounds(chunk_tokens=37, reply_tokens=8, instructions_tokens=0)
    fp = bounded_footprint({"sink_chunks": 1, "window_chunks": 4}, bounds, block_size=32)
    assert (fp.sinks, fp.window, fp.remnants, fp.chunk, fp.reply) == (45, 180, 62, 37, 8)
    assert fp.tokens == 332 and fp.blocks == math.ceil(332 / 32)
    problem = budget_problem(fp, max_position=150, max_model_len=2048)
    assert problem is not None and "332" in problem and "max_position=150" in problem
    assert budget_problem(fp, max_position=8192, max_model_len=332) is not None
    assert budget_problem(fp, max_position=8192, max_model_len=333) is None


def test_frame_tokens_from_the_processor_config() -> None:
    config = {
        "image_processor": {"patch_size": 14, "merge_size": 2, "size": {"longest_edge": 50176}},
        "video_processor": {
            "patch_size": 14,
            "merge_size": 2,
            "temporal_patch_size": 2,
            "size": {"longest_edge": 50176},
        },
    }
    assert max_image_tokens(config) == 64  # 224x224 at most: (224/28)^2
    assert max_image_tokens({}) is None
    bounds = media_bounds(config)
    assert bounds is not None
    # One image, or a clip of at most that many frames (frames pair up in time).
    assert bounds.chunk_tokens(1) == bounds.chunk_tokens(2) == 64
    assert bounds.chunk_tokens(16) == 8 * 64
    assert bounds.clip_tokens(3) == 2 * 64
    assert media_bounds({}) is None


@st.composite
def split_scenarios(
    draw: st.DrawFn,
) -> tuple[dict[str, int | float | None], ChunkBounds, int, list[tuple[str, int, int]]]:
    block_size = draw(st.sampled_from([16, 32, 128]))
    chunk_cap = draw(st.integers(1, 300))
    reply_cap = draw(st.integers(1, 64))
    instructions = draw(st.integers(0, 200))
    budget: dict[str, int | float | None] = {
        "sink_chunks": draw(st.integers(0, 2)),
        "sink_tokens": draw(st.integers(0, 100)),
        "window_chunks": draw(st.integers(1, 8)),
        "window_tokens": draw(st.none() | st.integers(1, 1000)),
        "text_window_tokens": draw(st.integers(1, 600)),
        "low_watermark_ratio": draw(st.sampled_from([0.25, 0.5, 0.75, 1.0])),
    }
    chunks = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["frame", "text"]),
                st.just(chunk_cap) | st.integers(1, chunk_cap),
                # 1: an ingested chunk (its one sampled token is dropped at the fold)
                st.just(reply_cap) | st.integers(1, reply_cap) | st.just(1),
            ),
            min_size=1,
            max_size=80,
        )
    )
    return budget, ChunkBounds(chunk_cap, reply_cap, instructions), block_size, chunks


def simulate_split_peak(
    budget_args: dict[str, int | float | None],
    bounds: ChunkBounds,
    block_size: int,
    chunks: list[tuple[str, int, int]],
) -> int:
    """What eviction.py does with a text window: the previous chunk and its kept reply become
    two segments (its kind, "reply"), then the frame round and the text round."""
    from retention.policy import eviction_rounds

    budget = RetentionBudget(**{k: v for k, v in budget_args.items() if v is not None})  # type: ignore[arg-type]
    history = SessionHistory.for_budget(budget)
    held = 0
    peak = 0
    pending: tuple[str, int] | None = None
    for i, (kind, chunk, reply) in enumerate(chunks):
        if i == 0:
            chunk += bounds.instructions_tokens
        if pending is not None and held > history.num_tokens:
            new = held - history.num_tokens
            pinned = i - 1 < budget.sink_chunks
            prompt = max(1, min(pending[1], new))
            history = append_segment(history, pending[0], prompt, pinned=pinned)
            if new > prompt:
                history = append_segment(history, "reply", new - prompt, pinned=pinned)
        for plan_round in eviction_rounds(budget):
            plan = plan_round(history, budget, block_size, 0)
            if plan.ranges or plan.dropped_segments:
                history = apply_eviction(history, plan.ranges, dropped=plan.dropped_segments)
        peak = max(peak, history.num_tokens + chunk + reply)
        held = history.num_tokens + chunk + reply - 1
        pending = (kind, chunk)
    return blocks_for(peak, block_size)


@settings(max_examples=1500, deadline=None)
@given(split_scenarios())
def test_reservation_bounds_the_peak_with_a_text_window(
    scenario: tuple[dict[str, int | float | None], ChunkBounds, int, list[tuple[str, int, int]]],
) -> None:
    budget, bounds, block_size, chunks = scenario
    footprint = bounded_footprint(budget, bounds, block_size)
    peak = simulate_split_peak(budget, bounds, block_size, chunks)
    assert peak <= footprint.blocks, (peak, footprint)
