"""A bounded session's bookkeeping on the scheduler side: its state, what its chunks' sampling
params say, and how the tokens computed since a fold become segments of its history.

Pure bookkeeping over `retention.policy`: nothing here touches a vLLM request's internals
(request_rewrite.py does) or the KV cache. eviction.py's "Theory of operation" says what the
fields mean.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from retention.policy import (
    CHUNK_HEAD_KEY,
    CHUNK_KIND_KEY,
    CONSOLIDATE,
    CONTROL_KEY,
    REQUEST_ARGS_KEY,
    ConsolidationMode,
    RetentionBudget,
    SegmentKind,
    SessionHistory,
    append_segment,
)
from retention.records import SessionSnapshot
from retention.vllm_adapter.errors import VLLMAdapterError


class RetentionConfigError(VLLMAdapterError, ValueError):
    """A retention budget that this engine cannot serve."""


@dataclass
class SessionRetentionState:
    budget: RetentionBudget
    history: SessionHistory
    max_position: int
    evict_calls: int = 0
    blocks_freed_total: int = 0
    fold: int = 0
    encoder_entries_released: int = 0
    encoder_inputs_scheduled: int = 0
    preemptions: int = 0
    # With a text window: the kind and prompt length of the chunk folded in last, and how many
    # chunks came (the first `sink_chunks` are pinned, their replies with them).
    pending_kind: SegmentKind = "chunk"
    pending_prompt: int = 0
    pending_head: int = 0
    chunks: int = 0
    # The largest chunk + reply folded in so far (what the next one is expected to need), and
    # whether the last fold was a control chunk (its report answers no chunk).
    largest_incoming: int = 0
    control_fold: bool = False
    # A re-prefill (consolidation or preemption resume) runs until this many tokens are
    # computed, in steps of repeating sizes (`step_cap`).
    reprefill_end: int = 0
    idle_consolidations: int = 0
    # How this session consolidates (its budget's mode, or the engine's; rotate only where the
    # worker can), and how often a rotation fell back to a re-prefill (a block shared).
    consolidation: ConsolidationMode = "reprefill"
    rotations: int = 0
    rotation_fallbacks: int = 0
    # A rebuilt session (issue #39): the history its first chunk (the snapshot's tokens) is
    # recorded as at the first fold, instead of one chunk.
    restore: SessionSnapshot | None = None
    # mRoPE: positions beyond the token cursor (see "Positions (mRoPE)" above): per recorded
    # chunk segment (by index), their sum over the chunks computed since the last re-prefill
    # plus the re-prefill's survivors, and the excess of the chunk folded in last (recorded at
    # the next fold with its segment).
    excess_by_segment: dict[int, int] = field(default_factory=dict)
    position_excess: int = 0
    pending_excess: int = 0


def budget_of(sampling_params: Any) -> RetentionBudget | None:
    extra = getattr(sampling_params, "extra_args", None)
    if not extra or REQUEST_ARGS_KEY not in extra:
        return None
    raw = extra[REQUEST_ARGS_KEY]
    if not isinstance(raw, dict):
        raise RetentionConfigError(f"{REQUEST_ARGS_KEY} must be a mapping")
    return RetentionBudget.from_request_args(raw)


def chunk_kind(sampling_params: Any) -> SegmentKind:
    extra = getattr(sampling_params, "extra_args", None) or {}
    return "text" if extra.get(CHUNK_KIND_KEY) == "text" else "frame"


def is_consolidation_control(sampling_params: Any) -> bool:
    extra = getattr(sampling_params, "extra_args", None) or {}
    return bool(extra.get(CONTROL_KEY) == CONSOLIDATE)


def chunk_head(sampling_params: Any) -> int:
    extra = getattr(sampling_params, "extra_args", None) or {}
    head = extra.get(CHUNK_HEAD_KEY, 0)
    return head if isinstance(head, int) and not isinstance(head, bool) and head > 0 else 0


def note_excess(state: SessionRetentionState, index: int) -> None:
    """The chunk folded in last is recorded now as segment `index`: its excess with it."""
    if state.pending_excess:
        state.excess_by_segment[index] = state.pending_excess
        state.position_excess += state.pending_excess
    state.pending_excess = 0


def rebase_excess(state: SessionRetentionState, history: SessionHistory) -> None:
    """After a re-prefill (consolidation or preemption resume): positions restart from 0 over
    the held tokens, so the excess is that of the chunks still held (a remnant counted whole:
    an upper bound)."""
    held = {seg.index for seg in history.segments}
    state.excess_by_segment = {i: e for i, e in state.excess_by_segment.items() if i in held}
    state.position_excess = sum(state.excess_by_segment.values())


def record_chunk(
    state: SessionRetentionState, history: SessionHistory, new_tokens: int
) -> SessionHistory:
    """The tokens computed since the last fold as segments: one "chunk" segment (the chunk
    and its kept reply), or with a text window the chunk's head that closes the previous
    reply ("reply"), the chunk ("text" or "frame") and its reply ("reply") apart."""
    budget = state.budget
    if budget.text_window_tokens is None:
        note_excess(state, history.next_index)
        return append_segment(history, "chunk", new_tokens)
    pinned = state.chunks < budget.sink_chunks
    state.chunks += 1
    # The chunk's head closes the previous reply's turn: text, kept with that reply.
    head = min(state.pending_head, state.pending_prompt - 1, new_tokens - 1)
    if head > 0:
        history = append_segment(history, "reply", head, pinned=pinned)
        new_tokens -= head
    prompt = max(1, min(state.pending_prompt - max(head, 0), new_tokens))
    note_excess(state, history.next_index)
    history = append_segment(history, state.pending_kind, prompt, pinned=pinned)
    if new_tokens > prompt:
        history = append_segment(history, "reply", new_tokens - prompt, pinned=pinned)
    return history
