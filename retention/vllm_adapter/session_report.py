"""What a bounded session reports about itself: the counters sent with every reply, and the
per-token detail tests and benchmarks read (`introspect.retention_state`)."""

from __future__ import annotations

from typing import Any

from retention.policy import TEXT_KINDS
from retention.vllm_adapter.session_state import SessionRetentionState


def summary(state: SessionRetentionState) -> dict[str, Any]:
    """The counters only, cheap enough for every frame (the server reports them per reply)."""
    h = state.history
    return {
        "segments": len(h.segments),
        # Whole chunks held; remnants (tokens of a dropped chunk that share a block with a
        # survivor) are counted in tokens, not as retained chunks.
        # With a text window a reply is a segment of its own, not a chunk.
        "chunks_retained": len(
            {seg.index for seg in h.segments if not seg.remnant and seg.kind != "reply"}
        ),
        "text_tokens": sum(
            seg.num_tokens for seg in h.segments if not seg.remnant and seg.kind in TEXT_KINDS
        ),
        "remnant_tokens": sum(seg.num_tokens for seg in h.segments if seg.remnant),
        "chunks_evicted": h.chunks_evicted_total,
        "tokens_evicted": h.tokens_evicted_total,
        "tokens_held": h.num_tokens,
        "evictions": h.evictions_total,
        "consolidations": h.consolidations_total,
        "idle_consolidations": state.idle_consolidations,
        "rotations": state.rotations,
        "rotation_fallbacks": state.rotation_fallbacks,
        "preemptions": state.preemptions,
    }


def describe(state: SessionRetentionState, request: Any) -> dict[str, Any]:
    """`summary` plus per-token detail, for tests and benchmarks."""
    h = state.history
    positions: list[int] = []
    for seg in h.segments:
        positions.extend(range(seg.position_start, seg.position_start + seg.num_tokens))
    return {
        **summary(state),
        "position_cursor": h.next_position(),
        # mRoPE: the cursor plus the excess (an upper bound of the largest position + 1).
        "position_excess": state.position_excess + state.pending_excess,
        "consolidation": state.consolidation,
        "blocks_freed_total": state.blocks_freed_total,
        "fold": state.fold,
        "mm_items_held": len(request.mm_features or ()),
        "mm_items_with_data": sum(1 for f in request.mm_features or () if f.data is not None),
        "encoder_entries_released": state.encoder_entries_released,
        "encoder_inputs_scheduled": state.encoder_inputs_scheduled,
        "history_positions": positions,
        "segment_chunks": [
            [seg.index, seg.kind, seg.start, seg.end, seg.remnant] for seg in h.segments
        ],
        "token_ids": list(request._all_token_ids[: h.num_tokens]),
    }
