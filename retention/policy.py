"""Retention policy of a bounded streaming session: which old chunks to evict, and the bookkeeping.

Pure Python (standard library only): no torch, no vLLM, no I/O. The vLLM adapter executes what
this module decides and reports back what it really freed.

Theory of operation
===================

A session is ONE long-lived request whose KV cache holds a token sequence in *cache order*
(index 0 = first token held). Every chunk folded into it is a :class:`HistorySegment` of a
:data:`SegmentKind` (a whole chunk with its kept reply, or with a text window its prompt and its
reply apart); a :class:`SessionHistory` is the tuple of
segments in cache order plus counters.

Invariant (checked whenever a :class:`SessionHistory` is built):

* segments tile ``[0, num_tokens)``: the first starts at 0 and each starts where the previous
  one ends (no gaps, no overlaps, non-empty);
* chunk indices never decrease; two segments share an index only when both are *remnants*
  (pieces of one dropped chunk), and every index is below ``next_index``;
* RoPE positions (1D) strictly increase along the cache: a segment's tokens have positions
  ``position_start .. position_start + num_tokens - 1``, and the next segment starts above
  them. Gaps are allowed (they are where evicted tokens were); ``next_position()`` is above
  every position held;
* a pinned segment (a *sink*) is never a remnant and is never freed.

Budget and watermarks. A :class:`RetentionBudget` keeps *sinks* forever (the first
``sink_chunks`` chunks, which :func:`append_segment` pins, every pinned segment, and the first
``sink_tokens`` tokens) and bounds the rest with a sliding window of ``window_chunks`` chunks
and/or ``window_tokens`` tokens (the *high watermarks*). Eviction runs only when the retained
(non-sink) part exceeds a high watermark, and then evicts down to the *low watermark*
(``floor(window * low_watermark_ratio)``, at least 1) so that it runs in batches, not on every
chunk. With both windows, either one triggers and both must end at or below their low mark.

Planning (:func:`plan_eviction`). The candidates are the non-sink segments that lie wholly
before the protected tail (the last ``protected_tail_tokens`` tokens: the chunk being prefilled
and the tokens being decoded), oldest first. The plan drops the shortest oldest-first prefix of
candidates that reaches the low watermarks (all candidates if none does). Adjacent dropped
segments are coalesced into one run, and each run, clipped to ``[sink_tokens, ...)``, is
rounded INWARD to whole KV blocks (``ceil(start / bs) * bs .. floor(end / bs) * bs``), because
only whole blocks can be returned to the pool. The ranges are therefore block-aligned,
disjoint, sorted, in current cache coordinates, and never touch a sink or the protected tail.

Remnants. Rounding inward can leave up to ``bs - 1`` tokens of a dropped run at each end: the
head of its first segment and the tail of its last one. Those tokens stay in the cache as
*remnant* segments (kind, index and positions kept, ``remnant=True``). A remnant
no longer counts as a chunk of the window (its tokens still count as retained tokens) and,
being the oldest candidate, is dropped again with the next batch, where it usually falls inside
the next coalesced run. The tokens sharing a block with a sink (right after the sinks) can
never be freed; they stay a remnant for good (at most ``bs - 1`` tokens per pinned region).

Applying (:func:`apply_eviction`). The KV layer may free less than planned, so the history is
updated from the ranges it ACTUALLY freed: segments inside a range disappear, segments cut by
one are trimmed (or split) into remnants, and every later offset shifts left by the width freed
before it (the KV table is compacted). Survivors keep their original positions. Segments the
plan dropped but the KV layer did not touch become remnants (pass ``plan.dropped_segments``),
so the policy does not count them as window chunks again and retries them next batch.

Positions. Positions continue from ``next_position()`` (never reused by eviction, so they
keep growing); :func:`needs_consolidation` says when the next chunk would reach the position
limit, and :func:`consolidate` renumbers the survivors ``0 .. n - 1`` (done together with a
re-prefill of the compacted context, e.g. a self-preempting request).
"""

from __future__ import annotations

import math
import statistics
from bisect import bisect_right
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from functools import lru_cache
from typing import Final, Literal, TypeAlias, get_args

__all__ = [
    "CHUNK_HEAD_KEY",
    "CHUNK_KIND_KEY",
    "CONSOLIDATE",
    "CONTROL_KEY",
    "REPORT_KEY",
    "REQUEST_ARGS_KEY",
    "RESTORE_KEY",
    "SEGMENT_KINDS",
    "SNAPSHOT_KEY",
    "TEXT_KINDS",
    "EvictionPlan",
    "HistorySegment",
    "PlanFn",
    "RetentionBudget",
    "SegmentKind",
    "SessionHistory",
    "append_segment",
    "apply_eviction",
    "consolidate",
    "eviction_rounds",
    "idle_consolidation_due",
    "needs_consolidation",
    "plan_eviction",
    "plan_frame_eviction",
    "plan_text_eviction",
    "reprefill_piece",
    "reprefill_pieces",
    "retained_chunks",
    "retained_tokens",
]

SegmentKind: TypeAlias = Literal["chunk", "text", "frame", "reply"]
"""What a segment holds, as the vLLM adapter records it: "chunk", a whole chunk and its kept reply
(one window); with ``text_window_tokens`` a chunk's prompt, "text" (a question or text turn) or
"frame", and "reply" (a reply, with the head of the next chunk that closes its turn)."""

SEGMENT_KINDS: Final[frozenset[str]] = frozenset(get_args(SegmentKind))

TEXT_KINDS: Final[frozenset[str]] = frozenset({"text", "reply"})
"""Kinds kept by ``text_window_tokens`` when it is set (questions, text turns, replies)."""

CHUNK_KIND_KEY: Final = "streaming_chunk_kind"
"""``SamplingParams.extra_args`` key naming a chunk's kind: "text" (a question or text turn,
kept by ``text_window_tokens``) or anything else (a frame, kept by the frame window)."""

CHUNK_HEAD_KEY: Final = "streaming_chunk_head"
"""``SamplingParams.extra_args`` key: how many leading tokens of a chunk close the previous
reply's turn (they are kept with that reply, as text, when ``text_window_tokens`` is set)."""

REQUEST_ARGS_KEY: Final = "streaming_retention"
"""Key of the budget dict in ``SamplingParams.extra_args``."""

CONTROL_KEY: Final = "streaming_control"
"""``SamplingParams.extra_args`` key of a *control chunk*: a chunk that carries no content for
the session. Its prompt tokens are dropped by the scheduler at the fold, and the one token it
samples is dropped by the next fold, so the context gains nothing from it."""

REPORT_KEY: Final = "streaming_report"
"""``SamplingParams.extra_args`` key: true asks EngineCore for the session's
``records.SessionReport`` on every chunk boundary. A bounded session (``REQUEST_ARGS_KEY``) gets
one without asking; a streaming request that asks for neither gets none, as from stock vLLM."""

SNAPSHOT_KEY: Final = "streaming_snapshot"
"""``SamplingParams.extra_args`` key: true asks EngineCore to put the session's
``records.SessionSnapshot`` in every chunk boundary's report (a session store rebuilds it
elsewhere from that)."""

RESTORE_KEY: Final = "streaming_restore"
"""``SamplingParams.extra_args`` key of a rebuilt session's first chunk: the ``SessionSnapshot``
(without its tokens, which are the chunk's prompt) whose history the first fold takes over."""

CONSOLIDATE: Final = "consolidate"
"""The control chunk that consolidates a bounded session now, while it is idle."""

ConsolidationMode: TypeAlias = Literal["rotate", "reprefill"]
"""How a consolidation resets positions to ``0 .. n - 1``:

* ``rotate``: the survivors' cached keys are rotated in place to their new positions (RoPE
  attention depends on position differences only, so a key computed at ``p`` and rotated by
  ``q - p`` is the key computed at ``q``). Costs a pass over the held keys, no model step; the
  survivors keep the KV they were computed with, as between consolidations. 1D RoPE only.
* ``reprefill``: every block is freed and the survivors are recomputed (self-preemption);
  their KV then holds only what the window holds. Costs a prefill of the window.
"""
CONSOLIDATION_MODES: Final[tuple[ConsolidationMode, ...]] = get_args(ConsolidationMode)

_INT_KEYS: Final = ("sink_tokens", "sink_chunks")
_OPTIONAL_INT_KEYS: Final = ("window_chunks", "window_tokens", "max_position", "text_window_tokens")
_RATIO_KEY: Final = "low_watermark_ratio"
_MODE_KEY: Final = "consolidation"
_REQUEST_KEYS: Final = (*_INT_KEYS, *_OPTIONAL_INT_KEYS, _RATIO_KEY, _MODE_KEY)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# --------------------------------------------------------------------------- segments


@dataclass(frozen=True)
class HistorySegment:
    """One chunk (or a remnant piece of one) as the KV cache holds it.

    ``start``/``end`` are token offsets in the CURRENT cache coordinates (``[start, end)``);
    ``position_start`` is the original RoPE position of the first token (positions are
    contiguous inside a segment).
    """

    index: int
    kind: SegmentKind
    start: int
    end: int
    position_start: int
    pinned: bool = False
    remnant: bool = False

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"segment index must be >= 0, got {self.index}")
        if self.kind not in SEGMENT_KINDS:
            raise ValueError(
                f"segment kind must be one of {sorted(SEGMENT_KINDS)}, got {self.kind!r}"
            )
        if not 0 <= self.start < self.end:
            raise ValueError(f"segment needs 0 <= start < end, got [{self.start}, {self.end})")
        if self.position_start < 0:
            raise ValueError(f"segment position_start must be >= 0, got {self.position_start}")
        if self.pinned and self.remnant:
            raise ValueError(f"segment {self.index}: a pinned segment cannot be a remnant")

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def position_end(self) -> int:
        """One past the last position of the segment."""
        return self.position_start + self.num_tokens


# --------------------------------------------------------------------------- budget


@lru_cache(maxsize=256)
def _scaled(window: int, ratio: float) -> int:
    # Fraction(str(...)) takes the ratio as written (0.57 -> 57/100), so no float round-off.
    return max(1, math.floor(window * Fraction(str(ratio))))


@dataclass(frozen=True)
class RetentionBudget:
    """What a session keeps: sinks forever, plus a sliding window (chunks and/or tokens).

    ``window_tokens`` / ``window_chunks`` are the high watermarks; eviction brings the retained
    non-sink part down to ``floor(window * low_watermark_ratio)`` (at least 1). ``max_position``
    is the exclusive RoPE position limit (positions must stay ``< max_position``), used by
    :func:`needs_consolidation`. Built instances are always valid (checked on construction).
    """

    sink_tokens: int = 0
    sink_chunks: int = 0
    window_chunks: int | None = None
    window_tokens: int | None = None
    low_watermark_ratio: float = 0.75
    max_position: int | None = None
    text_window_tokens: int | None = None
    consolidation: ConsolidationMode | None = None  # None: the engine's default

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> RetentionBudget:
        """Raise ValueError (naming the field) on nonsense; return self."""
        for name in _INT_KEYS:
            value = getattr(self, name)
            if not _is_int(value) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name in _OPTIONAL_INT_KEYS:
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")
        ratio = self.low_watermark_ratio
        if (
            not isinstance(ratio, (int, float))
            or isinstance(ratio, bool)
            or not math.isfinite(ratio)
            or not 0 < ratio <= 1
        ):
            raise ValueError(f"low_watermark_ratio must be in (0, 1], got {ratio!r}")
        if self.window_chunks is None and self.window_tokens is None:
            raise ValueError("a retention budget needs window_chunks or window_tokens (or both)")
        if self.consolidation is not None and self.consolidation not in CONSOLIDATION_MODES:
            raise ValueError(
                f"consolidation must be one of {', '.join(CONSOLIDATION_MODES)} or None, "
                f"got {self.consolidation!r}"
            )
        if self.max_position is not None:
            needed = self.sink_tokens + (self.window_tokens or 0) + (self.text_window_tokens or 0)
            if needed > self.max_position:
                raise ValueError(
                    f"max_position {self.max_position} leaves no room: sink_tokens + "
                    f"window_tokens + text_window_tokens = {needed}"
                )
        return self

    @classmethod
    def from_request_args(cls, d: Mapping[str, object]) -> RetentionBudget:
        """Parse ``SamplingParams.extra_args["streaming_retention"]``.

        Keys: sink_tokens, sink_chunks (int >= 0), window_chunks, window_tokens, max_position
        (int >= 1 or null), low_watermark_ratio (number in (0, 1]); all optional, but a window
        is required. Unknown keys and wrong types raise ValueError naming the key.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"{REQUEST_ARGS_KEY} must be a mapping, got {type(d).__name__}")
        kwargs: dict[str, object] = {}
        for key, value in d.items():
            where = f"{REQUEST_ARGS_KEY}.{key}"
            if key in _INT_KEYS:
                if not _is_int(value):
                    raise ValueError(f"{where} must be an integer, got {type(value).__name__}")
            elif key in _OPTIONAL_INT_KEYS:
                if value is not None and not _is_int(value):
                    raise ValueError(
                        f"{where} must be an integer or null, got {type(value).__name__}"
                    )
            elif key == _RATIO_KEY:
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    raise ValueError(f"{where} must be a number, got {type(value).__name__}")
                value = float(value)
            elif key == _MODE_KEY:
                if value is not None and not isinstance(value, str):
                    raise ValueError(
                        f"{where} must be a string or null, got {type(value).__name__}"
                    )
            else:
                raise ValueError(
                    f"{REQUEST_ARGS_KEY}: unknown key {key!r} (allowed: {', '.join(_REQUEST_KEYS)})"
                )
            kwargs[key] = value
        try:
            return cls(**kwargs)  # type: ignore[arg-type]  # types checked just above
        except ValueError as exc:
            raise ValueError(f"{REQUEST_ARGS_KEY}: {exc}") from None

    @property
    def low_watermark_tokens(self) -> int | None:
        if self.window_tokens is None:
            return None
        return _scaled(self.window_tokens, self.low_watermark_ratio)

    @property
    def low_watermark_chunks(self) -> int | None:
        if self.window_chunks is None:
            return None
        return _scaled(self.window_chunks, self.low_watermark_ratio)

    @property
    def low_watermark_text_tokens(self) -> int | None:
        if self.text_window_tokens is None:
            return None
        return _scaled(self.text_window_tokens, self.low_watermark_ratio)


# --------------------------------------------------------------------------- history


@dataclass(frozen=True)
class SessionHistory:
    """The segments the KV cache holds, in cache order, plus cumulative counters.

    ``next_index`` is the next chunk number; ``position_cursor`` the next RoPE position
    (``next_position()``); ``sink_chunks`` how many first chunks :func:`append_segment` pins.
    """

    segments: tuple[HistorySegment, ...] = ()
    next_index: int = 0
    position_cursor: int = 0
    sink_chunks: int = 0
    tokens_evicted_total: int = 0
    chunks_evicted_total: int = 0
    evictions_total: int = 0
    consolidations_total: int = 0

    def __post_init__(self) -> None:
        for name in (
            "next_index",
            "position_cursor",
            "sink_chunks",
            "tokens_evicted_total",
            "chunks_evicted_total",
            "evictions_total",
            "consolidations_total",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        prev: HistorySegment | None = None
        for seg in self.segments:
            expected_start = 0 if prev is None else prev.end
            if seg.start != expected_start:
                raise ValueError(
                    f"segment {seg.index} starts at {seg.start}, expected {expected_start}"
                    " (segments must tile the cache)"
                )
            if seg.index >= self.next_index:
                raise ValueError(f"segment index {seg.index} >= next_index {self.next_index}")
            if prev is not None:
                if seg.index < prev.index or (
                    seg.index == prev.index and not (seg.remnant and prev.remnant)
                ):
                    raise ValueError(f"segment index {seg.index} out of order after {prev.index}")
                if seg.position_start < prev.position_end:
                    raise ValueError(
                        f"segment {seg.index} position {seg.position_start} overlaps the "
                        f"previous segment (ends at {prev.position_end})"
                    )
            prev = seg
        if prev is not None and self.position_cursor < prev.position_end:
            raise ValueError(
                f"position_cursor {self.position_cursor} is below a held position "
                f"({prev.position_end - 1})"
            )

    @classmethod
    def for_budget(cls, budget: RetentionBudget) -> SessionHistory:
        """An empty history whose first ``budget.sink_chunks`` chunks will be pinned."""
        return cls(sink_chunks=budget.sink_chunks)

    @property
    def num_tokens(self) -> int:
        return self.segments[-1].end if self.segments else 0

    @property
    def num_chunks(self) -> int:
        """Distinct chunks with at least one token held (remnants included)."""
        return len({seg.index for seg in self.segments})

    def next_position(self) -> int:
        """Position of the next token appended: above every position ever handed out.

        Equals (max position held) + 1 whenever the newest segment is held (eviction never
        touches the protected tail).
        """
        return self.position_cursor

    def position_of(self, cache_index: int) -> int:
        """Original RoPE position of the token at ``cache_index``."""
        if not 0 <= cache_index < self.num_tokens:
            raise IndexError(f"cache index {cache_index} outside [0, {self.num_tokens})")
        seg = self.segments[bisect_right(self.segments, cache_index, key=_start) - 1]
        return seg.position_start + (cache_index - seg.start)

    def segment_at(self, cache_index: int) -> HistorySegment:
        """The segment holding the token at ``cache_index``."""
        if not 0 <= cache_index < self.num_tokens:
            raise IndexError(f"cache index {cache_index} outside [0, {self.num_tokens})")
        return self.segments[bisect_right(self.segments, cache_index, key=_start) - 1]


def _start(seg: HistorySegment) -> int:
    return seg.start


def append_segment(
    history: SessionHistory,
    kind: SegmentKind,
    num_tokens: int,
    *,
    pinned: bool = False,
) -> SessionHistory:
    """Record a chunk folded in at the end of the cache; positions continue from next_position().

    The chunk is pinned if ``pinned`` or if it is one of the first ``history.sink_chunks``.
    ``num_tokens`` must be >= 1 (an empty chunk holds nothing; do not record it).
    """
    if not _is_int(num_tokens) or num_tokens < 1:
        raise ValueError(f"num_tokens must be an integer >= 1, got {num_tokens!r}")
    start = history.num_tokens
    seg = HistorySegment(
        index=history.next_index,
        kind=kind,
        start=start,
        end=start + num_tokens,
        position_start=history.position_cursor,
        pinned=pinned or history.next_index < history.sink_chunks,
    )
    return replace(
        history,
        segments=(*history.segments, seg),
        next_index=history.next_index + 1,
        position_cursor=history.position_cursor + num_tokens,
    )


# --------------------------------------------------------------------------- accounting


def _is_sink(seg: HistorySegment, budget: RetentionBudget) -> bool:
    return seg.pinned or seg.index < budget.sink_chunks or seg.end <= budget.sink_tokens


def _sink_token_count(seg: HistorySegment, budget: RetentionBudget) -> int:
    if _is_sink(seg, budget):
        return seg.num_tokens
    return max(0, min(seg.end, budget.sink_tokens) - seg.start)


def retained_tokens(history: SessionHistory, budget: RetentionBudget) -> int:
    """Tokens held outside the sinks (remnants and the in-flight tail included)."""
    return sum(seg.num_tokens - _sink_token_count(seg, budget) for seg in history.segments)


def retained_chunks(history: SessionHistory, budget: RetentionBudget) -> int:
    """Chunks in the window: segments that are neither sinks nor remnants.

    A sink here is a pinned segment, one of the first ``budget.sink_chunks`` chunks, or a
    segment wholly inside the first ``budget.sink_tokens`` tokens.
    """
    return sum(1 for seg in history.segments if not seg.remnant and not _is_sink(seg, budget))


def _over(value: int, limit: int | None) -> bool:
    return limit is not None and value > limit


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class EvictionPlan:
    """Token ranges to free (``[start, end)``, cache coordinates) and what they mean.

    ``dropped_segments``: chunk indices the policy gives up on (pass them to
    :func:`apply_eviction`); ``evicted_segments``: those with no token left once ``ranges`` are
    freed; ``remnant_segments``: the others (some tokens stay, see module docstring).
    ``tokens_freed`` is the total width of ``ranges``.
    """

    ranges: tuple[tuple[int, int], ...] = ()
    dropped_segments: tuple[int, ...] = ()
    evicted_segments: tuple[int, ...] = ()
    remnant_segments: tuple[int, ...] = ()
    tokens_freed: int = 0

    @property
    def is_empty(self) -> bool:
        """Nothing to do: no range to free and nothing dropped."""
        return not self.ranges and not self.dropped_segments


def _align_inward(start: int, end: int, block_size: int) -> tuple[int, int] | None:
    aligned_start = -(-start // block_size) * block_size
    aligned_end = end // block_size * block_size
    return (aligned_start, aligned_end) if aligned_end > aligned_start else None


def plan_eviction(
    history: SessionHistory,
    budget: RetentionBudget,
    block_size: int,
    protected_tail_tokens: int,
) -> EvictionPlan:
    """Decide which oldest non-sink segments to drop and the block-aligned ranges to free.

    Empty plan unless a high watermark is exceeded; otherwise the shortest oldest-first prefix
    of candidates (non-sink segments wholly before the last ``protected_tail_tokens`` tokens)
    that reaches the low watermarks, or all candidates when none does.
    """
    if not _is_int(block_size) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    if not _is_int(protected_tail_tokens) or protected_tail_tokens < 0:
        raise ValueError(f"protected_tail_tokens must be >= 0, got {protected_tail_tokens!r}")
    tokens_now = retained_tokens(history, budget)
    chunks_now = retained_chunks(history, budget)
    if not (_over(tokens_now, budget.window_tokens) or _over(chunks_now, budget.window_chunks)):
        return EvictionPlan()

    tail_start = max(0, history.num_tokens - protected_tail_tokens)
    floor = budget.sink_tokens
    candidates = [
        seg for seg in history.segments if not _is_sink(seg, budget) and seg.end <= tail_start
    ]
    low_tokens, low_chunks = budget.low_watermark_tokens, budget.low_watermark_chunks

    closed: list[tuple[int, int]] = []  # aligned ranges of finished runs
    closed_freed = 0
    run_start = run_end = -1
    current: tuple[int, int] | None = None
    chunks_dropped = 0
    taken = 0
    for seg in candidates:
        if seg.start == run_end:
            run_end = seg.end
        else:
            if current is not None:
                closed.append(current)
                closed_freed += current[1] - current[0]
            run_start, run_end = seg.start, seg.end
        current = _align_inward(max(run_start, floor), run_end, block_size)
        taken += 1
        if not seg.remnant:
            chunks_dropped += 1
        freed = closed_freed + (current[1] - current[0] if current else 0)
        if not _over(tokens_now - freed, low_tokens) and not _over(
            chunks_now - chunks_dropped, low_chunks
        ):
            break
    ranges = (*closed, current) if current is not None else tuple(closed)
    return _describe(history, candidates[:taken], ranges)


def _covered(start: int, end: int, ranges: Sequence[tuple[int, int]]) -> int:
    return sum(max(0, min(end, b) - max(start, a)) for a, b in ranges)


def _describe(
    history: SessionHistory,
    dropped: Sequence[HistorySegment],
    ranges: tuple[tuple[int, int], ...],
) -> EvictionPlan:
    dropped_indices = tuple(dict.fromkeys(seg.index for seg in dropped))
    left: dict[int, int] = {}  # tokens of each dropped chunk that stay in cache
    for seg in history.segments:
        if seg.index in dropped_indices:
            kept = seg.num_tokens - _covered(seg.start, seg.end, ranges)
            left[seg.index] = left.get(seg.index, 0) + kept
    return EvictionPlan(
        ranges=ranges,
        dropped_segments=dropped_indices,
        evicted_segments=tuple(i for i in dropped_indices if left[i] == 0),
        remnant_segments=tuple(i for i in dropped_indices if left[i] > 0),
        tokens_freed=sum(b - a for a, b in ranges),
    )


# --------------------------------------------------------------------------- two budgets


def _is_text(seg: HistorySegment) -> bool:
    return seg.kind in TEXT_KINDS


def _plan_class(
    history: SessionHistory,
    budget: RetentionBudget,
    block_size: int,
    protected_tail_tokens: int,
    *,
    member: Callable[[HistorySegment], bool],
    weight: Callable[[HistorySegment], int],
    counted: Callable[[HistorySegment], bool],
    high_tokens: int | None,
    low_tokens: int | None,
    high_chunks: int | None,
    low_chunks: int | None,
    remnants_first: bool = False,
    remnant_allowance: int = 0,
) -> EvictionPlan:
    """One budget's round: its members (non-sink segments with ``member``) weigh ``weight``
    tokens and ``counted`` ones count as chunks; over a high watermark, the shortest
    oldest-first prefix of its candidates reaching the low watermarks (by planned tokens) is
    dropped, coalesced into runs of adjacent dropped segments and rounded inward."""
    if not _is_int(block_size) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    if not _is_int(protected_tail_tokens) or protected_tail_tokens < 0:
        raise ValueError(f"protected_tail_tokens must be >= 0, got {protected_tail_tokens!r}")
    members = [seg for seg in history.segments if not _is_sink(seg, budget) and member(seg)]
    tokens_now = sum(weight(seg) for seg in members)
    chunks_now = sum(1 for seg in members if counted(seg))
    if not (_over(tokens_now, high_tokens) or _over(chunks_now, high_chunks)):
        return EvictionPlan()
    tail_start = max(0, history.num_tokens - protected_tail_tokens)
    candidates = [seg for seg in members if seg.end <= tail_start]
    if remnants_first:
        # Remnants are pieces of chunks already given up: they go before any whole segment.
        candidates.sort(key=lambda seg: (not seg.remnant, seg.start))
    taken = 0
    dropped_tokens = dropped_chunks = 0
    for seg in candidates:
        taken += 1
        dropped_tokens += weight(seg)
        dropped_chunks += 1 if counted(seg) else 0
        if not _over(tokens_now - dropped_tokens, low_tokens) and not _over(
            chunks_now - dropped_chunks, low_chunks
        ):
            break
    dropped = sorted(candidates[:taken], key=lambda seg: seg.start)
    ranges = _freed_runs(dropped, budget.sink_tokens, block_size)
    if remnants_first and high_tokens is not None:
        # This budget weighs remnants too, and a dropped segment frees only the whole blocks
        # of its run: what the plan counted as dropped may stay, pinned between kept pieces.
        # The admission reservation (realtime/admission.py) allows `remnant_allowance` such
        # tokens (the ends of runs at held frames and sinks); past it, take more, oldest first,
        # so that the session stays inside its reservation (found by hypothesis: 1-token
        # replies kept between 13-token frames, blocks of 16, peak 7 blocks against 6).
        limit = high_tokens + remnant_allowance
        # Every freed token is a member's: a run holds only this budget's dropped segments.
        while tokens_now - sum(e - s for s, e in ranges) > limit and taken < len(candidates):
            taken += 1
            dropped = sorted(candidates[:taken], key=lambda seg: seg.start)
            ranges = _freed_runs(dropped, budget.sink_tokens, block_size)
    return _describe(history, dropped, tuple(ranges))


def _freed_runs(
    dropped: Sequence[HistorySegment], sink_tokens: int, block_size: int
) -> list[tuple[int, int]]:
    """Adjacent dropped segments coalesced into runs, each rounded inward to whole blocks."""
    ranges: list[tuple[int, int]] = []
    run_start = run_end = -1
    for seg in dropped:
        if seg.start == run_end:
            run_end = seg.end
            continue
        if run_end > run_start >= 0:
            aligned = _align_inward(max(run_start, sink_tokens), run_end, block_size)
            if aligned is not None:
                ranges.append(aligned)
        run_start, run_end = seg.start, seg.end
    if run_end > run_start >= 0:
        aligned = _align_inward(max(run_start, sink_tokens), run_end, block_size)
        if aligned is not None:
            ranges.append(aligned)
    return ranges


def plan_frame_eviction(
    history: SessionHistory,
    budget: RetentionBudget,
    block_size: int,
    protected_tail_tokens: int,
) -> EvictionPlan:
    """With a text window: the frame budget (``window_chunks`` / ``window_tokens``) over the
    frame segments. Remnants (of either kind) are taken along at no cost, so that runs of
    dropped frames coalesce across them; their tokens are charged to the text budget."""
    return _plan_class(
        history,
        budget,
        block_size,
        protected_tail_tokens,
        member=lambda seg: seg.remnant or not _is_text(seg),
        weight=lambda seg: 0 if seg.remnant else seg.num_tokens,
        counted=lambda seg: not seg.remnant,
        high_tokens=budget.window_tokens,
        low_tokens=budget.low_watermark_tokens,
        high_chunks=budget.window_chunks,
        low_chunks=budget.low_watermark_chunks,
    )


def plan_text_eviction(
    history: SessionHistory,
    budget: RetentionBudget,
    block_size: int,
    protected_tail_tokens: int,
) -> EvictionPlan:
    """With a text window: ``text_window_tokens`` over the text segments (questions, text
    turns, replies) and every remnant. Remnants (pieces of chunks already dropped, e.g. of
    frames that shared a block with kept text) are dropped first, then text oldest first: a
    newer remnant must not push out an older question. Empty plan without a text window."""
    if budget.text_window_tokens is None:
        return EvictionPlan()
    return _plan_class(
        history,
        budget,
        block_size,
        protected_tail_tokens,
        member=lambda seg: seg.remnant or _is_text(seg),
        weight=lambda seg: seg.num_tokens,
        counted=lambda seg: False,
        high_tokens=budget.text_window_tokens,
        low_tokens=budget.low_watermark_text_tokens,
        high_chunks=None,
        low_chunks=None,
        remnants_first=True,
        # Runs of dropped segments end at held frames and at the sinks; inward rounding may
        # leave block_size - 1 tokens at each end (the reservation's `remnants` term).
        remnant_allowance=2 * (block_size - 1) * (_frames_held(history, budget) + 1),
    )


def _frames_held(history: SessionHistory, budget: RetentionBudget) -> int:
    return sum(
        1
        for seg in history.segments
        if not _is_sink(seg, budget) and not seg.remnant and not _is_text(seg)
    )


PlanFn: TypeAlias = Callable[[SessionHistory, RetentionBudget, int, int], EvictionPlan]


def eviction_rounds(budget: RetentionBudget) -> tuple[PlanFn, ...]:
    """The planning rounds of one fold, to run in order (apply each before planning the next).

    Without a text window: one round, :func:`plan_eviction` (a reply is part of its chunk's
    segment). With ``text_window_tokens``: frames first (:func:`plan_frame_eviction`), then
    text and every remnant (:func:`plan_text_eviction`), so the remnants the frame round leaves
    are charged to the text budget at once. Eviction order: within each budget, oldest first.
    """
    if budget.text_window_tokens is None:
        return (plan_eviction,)
    return (plan_frame_eviction, plan_text_eviction)


# --------------------------------------------------------------------------- applying


def _checked_ranges(
    actually_freed: Sequence[tuple[int, int]], num_tokens: int
) -> list[tuple[int, int]]:
    ranges: list[tuple[int, int]] = []
    prev_end = 0
    for start, end in actually_freed:
        if start == end:
            continue  # an empty range (the KV layer freed nothing there)
        if not 0 <= start < end <= num_tokens:
            raise ValueError(f"freed range [{start}, {end}) outside [0, {num_tokens})")
        if start < prev_end:
            raise ValueError(f"freed range [{start}, {end}) overlaps or precedes the previous one")
        ranges.append((start, end))
        prev_end = end
    return ranges


def _pieces(start: int, end: int, ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``[start, end)`` minus the (sorted, disjoint) ranges."""
    pieces: list[tuple[int, int]] = []
    cursor = start
    for a, b in ranges:
        if b <= cursor or a >= end:
            continue
        if a > cursor:
            pieces.append((cursor, a))
        cursor = max(cursor, b)
    if cursor < end:
        pieces.append((cursor, end))
    return pieces


def apply_eviction(
    history: SessionHistory,
    actually_freed: Sequence[tuple[int, int]],
    *,
    dropped: Collection[int] = (),
) -> SessionHistory:
    """The history after the KV layer freed ``actually_freed`` (sorted, disjoint; may be less
    than planned; empty ``(s, s)`` entries are ignored) and compacted the cache.

    Segments inside a range disappear; segments cut by one keep their other tokens as remnants;
    every offset shifts left by the width freed before it; positions are unchanged. Chunks in
    ``dropped`` (``EvictionPlan.dropped_segments``) that keep tokens become remnants too.
    Raises ValueError for a range outside the cache or touching a pinned segment.
    """
    ranges = _checked_ranges(actually_freed, history.num_tokens)
    dropped_set = set(dropped)
    if not ranges and not dropped_set:
        return history
    segments: list[HistorySegment] = []
    freed_before = 0  # width of the ranges before the current piece
    range_iter = 0
    for seg in history.segments:
        pieces = _pieces(seg.start, seg.end, ranges)
        lost = seg.num_tokens - sum(b - a for a, b in pieces)
        if seg.pinned and (lost or seg.index in dropped_set):
            raise ValueError(f"segment {seg.index} is pinned (a sink) and cannot be evicted")
        for a, b in pieces:
            while range_iter < len(ranges) and ranges[range_iter][1] <= a:
                freed_before += ranges[range_iter][1] - ranges[range_iter][0]
                range_iter += 1
            new_start = a - freed_before
            remnant = seg.remnant or lost > 0 or seg.index in dropped_set
            if freed_before == 0 and not lost and remnant == seg.remnant:
                segments.append(seg)  # untouched, not moved
                continue
            segments.append(
                replace(
                    seg,
                    start=new_start,
                    end=new_start + (b - a),
                    position_start=seg.position_start + (a - seg.start),
                    remnant=remnant,
                )
            )
    freed = sum(b - a for a, b in ranges)
    chunks_gone = history.num_chunks - len({seg.index for seg in segments})
    return replace(
        history,
        segments=tuple(segments),
        tokens_evicted_total=history.tokens_evicted_total + freed,
        chunks_evicted_total=history.chunks_evicted_total + chunks_gone,
        evictions_total=history.evictions_total + (1 if freed else 0),
    )


# --------------------------------------------------------------------------- positions


def consolidate(history: SessionHistory) -> SessionHistory:
    """Renumber positions ``0 .. n - 1`` in cache order (with a re-prefill of the context)."""
    return replace(
        history,
        segments=tuple(replace(seg, position_start=seg.start) for seg in history.segments),
        position_cursor=history.num_tokens,
        consolidations_total=history.consolidations_total + 1,
    )


def rotation_runs(history: SessionHistory) -> tuple[tuple[int, int, int], ...]:
    """What a consolidation by rotation must do to the cached keys: ``(start, end, delta)``
    runs of cache indices whose tokens move from position ``index - delta`` to ``index``
    (what :func:`consolidate` renumbers them to). Sorted, disjoint, ``delta != 0``; adjacent
    runs with equal deltas are merged; tokens already at their index are left out."""
    runs: list[tuple[int, int, int]] = []
    for seg in history.segments:
        delta = seg.start - seg.position_start
        if delta == 0:
            continue
        if runs and runs[-1][1] == seg.start and runs[-1][2] == delta:
            runs[-1] = (runs[-1][0], seg.end, delta)
        else:
            runs.append((seg.start, seg.end, delta))
    return tuple(runs)


def needs_consolidation(
    history: SessionHistory,
    budget: RetentionBudget,
    incoming_tokens: int,
    max_position: int | None = None,
) -> bool:
    """Whether ``incoming_tokens`` more tokens would reach a position >= the position limit.

    The limit is ``max_position`` or else ``budget.max_position`` (exclusive: e.g. the model's
    trained range or max_model_len); False when neither is set. Consolidating helps only if
    ``history.num_tokens + incoming_tokens <= limit`` (evict first otherwise).
    """
    if not _is_int(incoming_tokens) or incoming_tokens < 0:
        raise ValueError(f"incoming_tokens must be an integer >= 0, got {incoming_tokens!r}")
    limit = max_position if max_position is not None else budget.max_position
    if limit is None:
        return False
    return history.next_position() + incoming_tokens > limit


def idle_consolidation_due(position_cursor: int, expected_incoming: int, limit: int | None) -> bool:
    """Whether a bounded session should consolidate now, while it is idle (between a reply
    and the next chunk), rather than on the next chunk's path.

    ``position_cursor`` is the next position the session would hand out (every token computed
    so far counted, the chunk just answered and its reply included); ``expected_incoming`` the
    largest chunk plus reply seen so far. True when a chunk that large would pass ``limit``
    (exclusive), i.e. the next fold would have to consolidate: :func:`needs_consolidation`
    on the same figures. False without a limit or before any chunk was seen.
    """
    for name, value in (("position_cursor", position_cursor), ("expected", expected_incoming)):
        if not _is_int(value) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    if limit is None or expected_incoming == 0:
        return False
    return position_cursor + expected_incoming > limit


def idle_time_suffices(recent_gaps_s: Sequence[float], consolidation_s: float | None) -> bool:
    """Whether to consolidate while idle, given the client's recent idle gaps (reply done →
    next chunk sent, seconds) and how long the last idle consolidation took.

    An idle consolidation that the next chunk must wait for costs that chunk more than doing it
    on the chunk's path (the chunk waits for the rest of it, in pieces, and then for its own
    prefill; measured in docs/history/benchmarks-2026.md), so it is worth starting only when the client
    usually leaves the time for it: the median recent gap is at least the last consolidation's
    duration. With no figure yet (no gap or no consolidation measured) it is tried.
    """
    gaps = list(recent_gaps_s)
    for value in (*gaps, consolidation_s):
        if value is not None and (not isinstance(value, int | float) or value < 0):
            raise ValueError(f"durations must be numbers >= 0, got {value!r}")
    if not gaps or consolidation_s is None:
        return True
    return statistics.median(gaps) >= consolidation_s


def reprefill_grain(piece: int) -> int:
    """The unit the rest of a re-prefill (under one piece) is cut in: ``piece // 8``, at least 1."""
    return max(1, piece // 8)


def reprefill_piece(remaining: int, piece: int) -> int:
    """Tokens to compute in the next step of a re-prefill that has ``remaining`` tokens left.

    Whole pieces of ``piece`` tokens first; then the rest in at most two steps: its whole
    grains (a multiple of :func:`reprefill_grain`, ``piece // 8``), then what is left (under one
    grain). Every step size is then ``piece``, one of 7 grain multiples or one of ``grain - 1``
    small sizes: a re-prefill of any length meets at most ``8 + grain - 1`` distinct step sizes
    (the CPU worker keeps state per distinct step size), in ``remaining // piece + 2`` steps at
    most. (Falling powers of two, the first version, met fewer sizes but took up to
    ``log2(piece) + 1`` steps for the rest: six for a 250-token SmolLM2 window, ~45 ms each on
    two cores, which made a re-prefill slower than one step; docs/history/benchmarks-2026.md.) ``piece`` must
    be a power of two; ``piece == 0`` disables the split (the whole rest in one step).
    """
    if not _is_int(remaining) or remaining < 1:
        raise ValueError(f"remaining must be an integer >= 1, got {remaining!r}")
    if not _is_int(piece) or piece < 0 or piece & (piece - 1):
        raise ValueError(f"piece must be 0 or a power of two, got {piece!r}")
    if piece == 0 or remaining >= piece:
        return piece or remaining
    grain = reprefill_grain(piece)
    return remaining - remaining % grain if remaining >= grain else remaining


def reprefill_pieces(total: int, piece: int) -> list[int]:
    """Every step of a re-prefill of ``total`` tokens, in order (:func:`reprefill_piece`)."""
    steps: list[int] = []
    while total > 0:
        steps.append(reprefill_piece(total, piece))
        total -= steps[-1]
    return steps
