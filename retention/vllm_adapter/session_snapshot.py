"""What rebuilds a bounded session elsewhere (issue #39), on the scheduler side: the snapshot
taken at a chunk boundary, and the history a rebuilt session's first chunk is recorded as.

The snapshot is the session consolidated: its tokens after the next fold's eviction (applied
here on paper), its segments renumbered from 0. A rebuild prefills those tokens as its first
chunk, which `record_or_restore` then records as the snapshot's segments.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from retention.policy import (
    RESTORE_KEY,
    SEGMENT_KINDS,
    HistorySegment,
    RetentionBudget,
    SessionHistory,
    apply_eviction,
    eviction_rounds,
)
from retention.records import SessionSnapshot
from retention.vllm_adapter.session_state import (
    RetentionConfigError,
    SessionRetentionState,
    record_chunk,
)


def restore_of(sampling_params: Any) -> SessionSnapshot | None:
    extra = getattr(sampling_params, "extra_args", None) or {}
    raw = extra.get(RESTORE_KEY)
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise RetentionConfigError(f"{RESTORE_KEY} must be a mapping")
    # The tokens are the chunk's prompt; the record carries only the history around them.
    return SessionSnapshot.from_dict({**raw, "token_ids": []}, check=False)


def restored_history(
    snapshot: SessionSnapshot, budget: RetentionBudget, num_tokens: int
) -> SessionHistory | None:
    """The history of a session rebuilt from `snapshot` whose first chunk (its `num_tokens`
    held tokens, prefilled at 0..n-1) just folded: the snapshot's segments, consolidated (as
    a re-prefill leaves them). None if the segments do not tile those tokens."""
    if sum(seg[2] for seg in snapshot.segments) != num_tokens or not snapshot.segments:
        return None
    segments: list[HistorySegment] = []
    start = 0
    for index, kind, n, pinned, remnant in snapshot.segments:
        if kind not in SEGMENT_KINDS:
            return None
        segments.append(
            HistorySegment(
                index=index,
                kind=kind,  # type: ignore[arg-type]  # checked against SEGMENT_KINDS just above
                start=start,
                end=start + n,
                position_start=start,
                pinned=pinned,
                remnant=remnant,
            )
        )
        start += n
    return SessionHistory(
        segments=tuple(segments),
        next_index=snapshot.next_index,
        position_cursor=num_tokens,
        sink_chunks=budget.sink_chunks,
        tokens_evicted_total=snapshot.tokens_evicted_total,
        chunks_evicted_total=snapshot.chunks_evicted_total,
        evictions_total=snapshot.evictions_total,
        consolidations_total=snapshot.consolidations_total + 1,
    )


def record_or_restore(
    state: SessionRetentionState, history: SessionHistory, new_tokens: int
) -> SessionHistory:
    """`_record`, or for a rebuilt session's first chunk the history it was rebuilt from."""
    if state.restore is not None and history.num_tokens == 0:
        restored = restored_history(state.restore, state.budget, new_tokens)
        if restored is not None:
            state.chunks = state.restore.chunks
            return restored
    return record_chunk(state, history, new_tokens)


def snapshot_of(state: SessionRetentionState, request: Any, block_size: int) -> SessionSnapshot:
    """What rebuilds this session (at a chunk boundary: the request is paused, and the
    chunk just answered is not recorded yet; it is recorded here as the next fold will)."""
    held = int(request.num_computed_tokens)
    history = state.history
    if held > history.num_tokens:
        probe = replace(state)  # `record_chunk` counts chunks on the state it is given
        history = record_or_restore(probe, history, held - history.num_tokens)
        chunks = probe.chunks
    else:
        held, chunks = history.num_tokens, state.chunks
    tokens = list(request._all_token_ids[:held])
    # The next fold's eviction, applied here on paper (it plans over the recorded history
    # alone): the snapshot is what a consolidation at the next fold would keep, so a rebuild
    # equals this session consolidated, and its own first fold evicts nothing more.
    for plan_round in eviction_rounds(state.budget):
        plan = plan_round(history, state.budget, block_size, 0)
        if plan.is_empty:
            continue
        for start, end in reversed(plan.ranges):
            del tokens[start:end]
        history = apply_eviction(history, plan.ranges, dropped=plan.dropped_segments)
    return SessionSnapshot(
        token_ids=tokens,
        segments=[
            (seg.index, seg.kind, seg.num_tokens, seg.pinned, seg.remnant)
            for seg in history.segments
        ],
        next_index=history.next_index,
        chunks=chunks,
        tokens_evicted_total=history.tokens_evicted_total,
        chunks_evicted_total=history.chunks_evicted_total,
        evictions_total=history.evictions_total,
        consolidations_total=history.consolidations_total,
    )
