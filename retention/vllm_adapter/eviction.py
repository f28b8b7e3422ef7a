"""Scheduler-side bounded sessions: record segments, evict in place, consolidate.

Theory of operation
===================
A retention session is a resumable request whose first chunk carries
``SamplingParams.extra_args["streaming_retention"]`` (a :class:`RetentionBudget`). Everything
happens when vLLM folds the next chunk into the paused request (the scheduler's
``_update_request_as_session``): at that moment nothing of the request is in flight and its KV is
complete up to ``num_computed_tokens``.

* Segments. The tokens computed since the last fold — the previous chunk's prompt and the reply
  tokens vLLM keeps — become one :class:`HistorySegment`, so a chunk and its reply are evicted
  together. The chunk just folded in is not recorded yet (it is the protected tail).
* Eviction. The pure policy plans block-aligned ranges; each is freed through the KV
  range-free primitive, highest range first, so the lower ranges' coordinates stay valid. For
  every range actually freed, every per-token array of the request is compacted by exactly that
  span (``_all_token_ids``, ``prompt_token_ids``, ``num_prompt_tokens``, ``num_computed_tokens``,
  ``block_hashes``, multimodal offsets), and prefix-cache reads are switched off for the request
  (its remaining hashes describe the uncompacted chain; ``capabilities.skip_prefix_cache_reads``).
  Where vLLM recomputes that switch at every fold (``prefix_cache_hit_limit``), it only matters
  until the chunk's first step: a lookup happens only for a request with nothing computed,
  i.e. after a preemption or a re-prefill, and both switch reads off again themselves. The worker mirrors it for free: vLLM
  sends a folded continuation to the worker as a new request carrying its full block table.
* Fold control. At the first chunk and at every fold the worker is sent one typed, versioned
  record, :class:`~retention.vllm_adapter.fold_control.FoldControl` (``fold_control.py``): fold
  number, position offset, tokens held before the eviction, the ranges evicted, re-prefill or
  not, preemptions so far. The worker checks it.
* Positions (1D RoPE). Survivors keep their original positions; a token computed now is at
  ``cache index + offset`` with ``offset = position cursor - tokens held`` (``positions.py``).
* Positions (mRoPE). The worker keeps each session's 3-D position tensor and slices/extends
  it itself from the record (see ``mrope.py``). The 1D cursor of the policy counts tokens; text
  advances one position per token and an image or clip of t×h×w tokens max(t, h, w) (Qwen2-VL,
  Qwen3-VL), but Qwen2.5-VL scales a clip's temporal positions by its duration, so a clip can
  span more positions than it has tokens. Each chunk's *excess* (``mrope.position_excess``,
  from the model's own position function run here on the chunk alone) is therefore recorded
  with its segment, and every decision on ``max_position`` uses the cursor plus the excess of
  the chunks computed since the last re-prefill (or held through it): an upper bound of the
  largest position the worker's tensor holds, so a session consolidates before it, never
  after. For models whose chunks never outgrow their tokens the excess is 0 and nothing
  changes.
* Multimodal items. A feature whose placeholders lie (even partly) in a freed range is dropped
  from ``mm_features`` with its data, and its encoder-cache entry is released at once (it is
  computed, so no request references it): the scheduler's ``EncoderCacheManager`` frees the
  slots and reports the hash, so the worker pops its tensor at the next step. Features the
  cache still holds keep their data (vLLM strips computed features' data from what it sends to
  the worker; the scheduler's copy is what a consolidation re-prefill needs if the encoder
  output was meanwhile evicted from the encoder cache), so frame data is bounded by the window.
* Consolidation. When the next chunk plus its reply would pass ``max_position`` (the model's
  trained range, or the budget's own limit), the request preempts itself: all its blocks are
  freed and it is re-prefilled from the compacted tokens with positions 0..n-1 (offset 0). The
  re-prefill includes the chunk just folded in, so the sample it produces IS the reply to that
  chunk; no sample of a re-prefill of old context alone is ever produced. For mRoPE models
  the remnants (pieces of evicted chunks, possibly holding placeholder tokens of a frame that
  is gone) are dropped first, so the re-prefill is a clean prompt of whole chunks.
* Idle consolidation. A consolidation on a chunk's path costs that chunk a re-prefill of the
  whole window. So at every chunk boundary the session's report says whether the next chunk
  (as large as the largest seen) would consolidate (``idle_consolidation_due``), and the front
  end (``realtime/engine_session.py``) then sends a *control chunk* right away, while the client
  is idle: ``extra_args[CONTROL_KEY] = CONSOLIDATE``, one token, max_tokens 1. Its fold records
  the previous chunk and reply as usual, evicts as usual, drops the control's own prompt tokens
  (never computed) and consolidates; the token it samples is dropped by the next fold, as an
  ingested chunk's is. The context therefore gains nothing, and the next chunk folds into a
  consolidated session (no new segment: everything computed is already recorded). A chunk that
  arrives meanwhile waits in the front end for the control's boundary (one chunk in flight);
  the report of a control chunk never asks for another one.
* Re-prefill step sizes. A re-prefill (consolidation or preemption resume) is scheduled in
  pieces: whole ``reprefill_piece`` tokens (128; ``serve --reprefill-piece``, 0 = one
  step), then falling powers of two (``policy.reprefill_piece``), through the scheduler's
  ``_reserve_prefill_lookahead`` hook, which vLLM calls for every request it schedules. The
  CPU worker keeps state per distinct step size (oneDNN, ~1.35 MB each); whole-window steps
  made a new size at nearly every consolidation.
* Preemption. Under KV pressure vLLM preempts a running request: it frees every block, sets
  ``num_computed_tokens`` to 0 and later recomputes the request from its token arrays. A
  bounded session resumes as a consolidation (``on_preempted``): its history is renumbered
  0..n-1, its hash chain is rebuilt over the compacted tokens (so the blocks the resume
  publishes are exactly what a plain prefill of those tokens computes, never stale content under
  an original-chain hash), and its position offset is 0. The worker cannot be told (a resumed
  request ships no sampling params), so it applies the same rule itself to every resumed
  retention request (``preemption.py``); the mRoPE fold record carries the preemption count
  and the worker checks it at the next fold. Remnants are not dropped here: the worker keeps
  its own token arrays across a preemption, so the tokens must stay as they are.
* Context guard. What a fold must fit is what the session holds AFTER this fold's eviction and
  consolidation: ``after_fold`` returns a reason when the held tokens still reach
  ``max_model_len``, or the next chunk and its reply still pass ``max_position`` right after a
  consolidation; the scheduler then ends the session (its budget was too large for its chunks).

Requests without the key take none of these paths (one dict lookup per fold).
"""

from __future__ import annotations

from typing import Any, Final

from retention.policy import (
    CONSOLIDATION_MODES,
    ConsolidationMode,
    RetentionBudget,
    SessionHistory,
    apply_eviction,
    consolidate,
    eviction_rounds,
    idle_consolidation_due,
    needs_consolidation,
    reprefill_piece,
    rotation_runs,
)
from retention.records import SessionSnapshot
from retention.vllm_adapter.fold_control import FoldControl, set_fold_control, with_offset_reset
from retention.vllm_adapter.mrope import PositionFunction, chunk_excess, local_features
from retention.vllm_adapter.request_rewrite import RequestRewriter
from retention.vllm_adapter.session_report import describe, summary
from retention.vllm_adapter.session_snapshot import record_or_restore, restore_of, snapshot_of
from retention.vllm_adapter.session_state import (
    RetentionConfigError,
    SessionRetentionState,
    budget_of,
    chunk_head,
    chunk_kind,
    is_consolidation_control,
    rebase_excess,
)

__all__ = [
    "DEFAULT_CONSOLIDATION",
    "DEFAULT_REPREFILL_PIECE",
    "RetentionConfigError",
    "SessionRetention",
    "SessionRetentionState",
    "consolidation_mode",
]


DEFAULT_REPREFILL_PIECE: Final = 128
"""Tokens per step of a re-prefill (a power of two; 0: the whole re-prefill in one step), when
the engine's settings name none (`settings.REPREFILL_PIECE_KEY`, `serve --reprefill-piece`)."""

DEFAULT_CONSOLIDATION: Final[ConsolidationMode] = "rotate"
"""The consolidation mode for sessions whose budget names none, when the engine's settings name
none either (`settings.CONSOLIDATION_KEY`, `serve --consolidation`). Rotation is used only where
the worker can rotate (1D RoPE, CPU attention)."""


def consolidation_mode(raw: object) -> ConsolidationMode:
    """A consolidation mode from the engine's settings (None: the default)."""
    if raw is None:
        return DEFAULT_CONSOLIDATION
    for mode in CONSOLIDATION_MODES:
        if raw == mode:
            return mode
    raise RetentionConfigError(
        f"the engine's consolidation setting must be one of {', '.join(CONSOLIDATION_MODES)}, "
        f"got {raw!r}"
    )


def _merge_freed(
    before: list[tuple[int, int]], later: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """Ranges freed by a later round (in coordinates compacted by `before`) mapped back to the
    coordinates before any of them, merged with `before`: sorted, disjoint, adjacent ones
    joined. A later range that spans a place where `before` freed tokens is split around it."""
    pieces = list(before)
    for a, b in later:
        shift = 0
        cursor = a  # compacted coordinate still to map
        for s0, e0 in sorted(before):
            if b <= cursor:
                break
            start = cursor + shift  # original coordinate of `cursor`
            if e0 <= start:
                shift += e0 - s0
                continue
            if s0 >= start + (b - cursor):
                break
            take = s0 - start  # tokens before this earlier range
            if take > 0:
                pieces.append((start, s0))
                cursor += take
            shift += e0 - s0
        if cursor < b:
            pieces.append((cursor + shift, b + shift))
    merged: list[tuple[int, int]] = []
    for a, b in sorted(pieces):
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], b)
        else:
            merged.append((a, b))
    return merged


class SessionRetention:
    """Per-scheduler registry of retention sessions, and their fold pipeline. Lives in the
    EngineCore process.

    Its jobs are split by module: the per-session state and segment recording
    (session_state.py), rewriting vLLM's request internals (request_rewrite.py), snapshot and
    restore (session_snapshot.py) and reporting (session_report.py). This class decides, at
    each fold, preemption and step, what happens to each session.
    """

    def __init__(
        self,
        kv_cache_manager: Any,
        block_size: int,
        model_max_position: int,
        *,
        max_model_len: int | None = None,
        uses_mrope: bool = False,
        encoder_cache_manager: Any = None,
        reprefill_piece: int = DEFAULT_REPREFILL_PIECE,
        rotation_supported: bool = False,
        default_consolidation: ConsolidationMode = DEFAULT_CONSOLIDATION,
        position_function: PositionFunction | None = None,
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.block_size = block_size
        self.model_max_position = model_max_position
        self.max_model_len = max_model_len
        self.uses_mrope = uses_mrope
        self.encoder_cache_manager = encoder_cache_manager
        piece = self.reprefill_piece = reprefill_piece
        if piece < 0 or piece & (piece - 1):
            raise RetentionConfigError(
                f"the re-prefill piece (--reprefill-piece) must be 0 or a power of two, got {piece}"
            )
        self.rotation_supported = rotation_supported and not uses_mrope
        self.default_consolidation = default_consolidation
        self.sessions: dict[str, SessionRetentionState] = {}
        self.rewrite = RequestRewriter(kv_cache_manager, block_size, encoder_cache_manager)
        # mRoPE: the model's own position function, to measure each chunk's excess.
        self.position_function = position_function

    # -- lifecycle

    def on_new_request(self, request: Any) -> None:
        if not getattr(request, "resumable", False):
            return
        budget = budget_of(request.sampling_params)
        if budget is None:
            return
        limit = self.model_max_position
        if budget.max_position is not None:
            limit = min(limit, budget.max_position)
        self.sessions[request.request_id] = SessionRetentionState(
            budget=budget,
            history=SessionHistory.for_budget(budget),
            max_position=limit,
            pending_kind=chunk_kind(request.sampling_params),
            pending_prompt=int(request.num_prompt_tokens),
            pending_head=0,
            consolidation=self._mode_for(budget),
            pending_excess=self._incoming_excess(request),
        )
        restore = restore_of(request.sampling_params)
        if restore is not None:
            state = self.sessions[request.request_id]
            state.restore = restore
            # The rebuild is the re-prefill of a consolidation: same pieces, same sums.
            state.reprefill_end = int(request.num_prompt_tokens)
        set_fold_control(request.sampling_params, FoldControl(fold=0, reset=True))

    def _mode_for(self, budget: RetentionBudget) -> ConsolidationMode:
        mode = budget.consolidation or self.default_consolidation
        return mode if mode == "reprefill" or self.rotation_supported else "reprefill"

    def on_finished(self, request_id: str) -> None:
        self.sessions.pop(request_id, None)

    def is_retention_session(self, request_id: str) -> bool:
        return request_id in self.sessions

    # -- the fold

    def after_fold(self, request: Any) -> str | None:
        """Called right after vLLM folded the next chunk into the paused request.

        Returns why the session cannot go on (its chunk and reply do not fit even after this
        fold's eviction and consolidation), or None.
        """
        state = self.sessions.get(request.request_id)
        if state is None:
            return None
        # Any re-prefill is over (a fold comes only after the chunk stopped): lift its cap.
        state.reprefill_end = 0
        computed = int(request.num_computed_tokens)
        history, control = self._record_fold(request, state, computed)
        history, freed = self._evict(request, state, history)
        incoming, new_excess = self._take_incoming(request, state, control)
        # Positions the chunk and its reply may reach beyond the token cursor (mRoPE excess).
        beyond = state.position_excess + new_excess
        history, reset, rotations = self._consolidate_if_due(
            request, state, history, control, incoming + beyond
        )
        state.history = history
        state.pending_excess = new_excess
        state.fold += 1
        set_fold_control(
            request.sampling_params,
            FoldControl(
                fold=state.fold,
                position_offset=history.next_position() - history.num_tokens,
                held_before=computed,
                evicted=tuple(sorted(freed)),
                reset=reset,
                preemptions=state.preemptions,
                rotations=rotations,
            ),
        )
        return self._does_not_fit(request, state, incoming)

    def _record_fold(
        self, request: Any, state: SessionRetentionState, computed: int
    ) -> tuple[SessionHistory, bool]:
        """Record what was computed since the last fold; note the chunk just folded in (the
        protected tail). Returns the history and whether this fold is a control chunk."""
        history = state.history
        new_tokens = computed - history.num_tokens
        if new_tokens > 0:
            history = record_or_restore(state, history, new_tokens)
            state.restore = None
        control = is_consolidation_control(request.sampling_params)
        state.control_fold = control
        if not control:
            # Its kind and prompt length, for the next fold to split it from its reply.
            state.pending_kind = chunk_kind(request.sampling_params)
            state.pending_prompt = int(request.num_tokens) - computed
            state.pending_head = chunk_head(request.sampling_params)
        return history, control

    def _evict(
        self, request: Any, state: SessionRetentionState, history: SessionHistory
    ) -> tuple[SessionHistory, list[tuple[int, int]]]:
        """Run the policy's eviction rounds; free and compact each planned range. Returns the
        history and the ranges freed, in the coordinates before this fold's eviction (the
        mRoPE fold record's)."""
        freed: list[tuple[int, int]] = []
        for plan_round in eviction_rounds(state.budget):
            plan = plan_round(history, state.budget, self.block_size, 0)
            round_freed: list[tuple[int, int]] = []
            for start, end in reversed(plan.ranges):
                a, b, n = self.rewrite.free_range(request, start, end)
                state.evict_calls += 1
                if n == 0:
                    continue
                state.blocks_freed_total += n
                self._compact_request(request, a, b, state)
                round_freed.append((a, b))
            if plan.ranges or plan.dropped_segments:
                history = apply_eviction(
                    history, sorted(round_freed), dropped=plan.dropped_segments
                )
            freed = _merge_freed(freed, sorted(round_freed))
        return history, freed

    def _take_incoming(
        self, request: Any, state: SessionRetentionState, control: bool
    ) -> tuple[int, int]:
        """The tokens the folded chunk and its reply will add, and its mRoPE excess."""
        if control:
            # A control chunk carries nothing: drop its prompt tokens (never computed) and
            # consolidate now, while the session is idle. The one token it samples is dropped
            # by the next fold, like an ingested chunk's.
            self.rewrite.drop_tail(request, int(request.num_computed_tokens))
            state.idle_consolidations += 1
            return 0, 0
        incoming = (
            int(request.num_tokens) - int(request.num_computed_tokens) + int(request.max_tokens)
        )
        new_excess = self._incoming_excess(request)
        state.largest_incoming = max(state.largest_incoming, incoming + new_excess)
        return incoming, new_excess

    def _consolidate_if_due(
        self,
        request: Any,
        state: SessionRetentionState,
        history: SessionHistory,
        forced: bool,
        reach: int,
    ) -> tuple[SessionHistory, bool, tuple[tuple[int, int, int], ...]]:
        """Consolidate (rotate in place, else re-prefill) when forced (an idle control chunk)
        or when `reach` more positions would pass the trained range. Returns the history,
        whether the request is re-prefilled, and the worker's rotations."""
        if not forced and not needs_consolidation(history, state.budget, reach, state.max_position):
            return history, False, ()
        runs = rotation_runs(history) if state.consolidation == "rotate" else ()
        if state.consolidation == "rotate" and self.rewrite.may_rotate(request, runs):
            # The worker rotates the survivors' keys to 0..n-1 before the next step.
            state.rotations += 1
            return consolidate(history), False, runs
        if state.consolidation == "rotate":
            state.rotation_fallbacks += 1
        if self.uses_mrope:
            history = self._drop_remnants(request, state, history)
        history = consolidate(history)
        self.rewrite.reprefill(request)
        state.reprefill_end = int(request.num_tokens)
        rebase_excess(state, history)
        return history, True, ()

    def snapshot(self, request: Any) -> SessionSnapshot:
        """What rebuilds this session (at a chunk boundary: the request is paused, and the
        chunk just answered is not recorded yet; it is recorded here as the next fold will)."""
        return snapshot_of(self.sessions[request.request_id], request, self.block_size)

    def _incoming_excess(self, request: Any) -> int:
        """The mRoPE excess of the chunk just folded in (its uncomputed tokens and items)."""
        if self.position_function is None:
            return 0
        start = int(request.num_computed_tokens)
        tokens = list(request._all_token_ids[start : int(request.num_tokens)])
        features = local_features(request.mm_features or (), start)
        return chunk_excess(self.position_function, tokens, features)

    def _does_not_fit(
        self, request: Any, state: SessionRetentionState, incoming: int
    ) -> str | None:
        held = int(request.num_tokens)
        if self.max_model_len is not None and held >= self.max_model_len:
            return (
                f"after this fold's eviction the session holds {held} tokens; it must stay "
                f"below max_model_len={self.max_model_len}"
            )
        end = (
            state.history.next_position() + incoming + state.position_excess + state.pending_excess
        )
        if end > state.max_position:
            return (
                f"the chunk and its reply would reach position {end} right after "
                f"a consolidation, past max_position={state.max_position}: the budget's sinks "
                "and window leave no room for them"
            )
        return None

    def on_preempted(self, request: Any) -> None:
        """vLLM preempted the session (its blocks are freed): resume it as a consolidation.

        The survivors are recomputed at 0..n-1 with the chain of hashes of the compacted tokens,
        so whatever the resume publishes to the prefix cache is what a plain prefill of those
        tokens holds; the worker resets its offset and mRoPE positions on its own
        (preemption.py). Reads stay off, so the resume is self-contained.
        """
        state = self.sessions.get(request.request_id)
        if state is None:
            return
        state.preemptions += 1
        state.history = consolidate(state.history)
        rebase_excess(state, state.history)
        state.reprefill_end = int(request.num_tokens)
        self.rewrite.rehash_for_resume(request)
        with_offset_reset(request.sampling_params)

    def idle_consolidation_due(self, request: Any) -> bool:
        """At a chunk boundary: whether the next chunk (as large as the largest seen) would
        consolidate on its own path, so the session should consolidate now, while idle. Never
        on the boundary of a control chunk itself (at most one per answered chunk)."""
        state = self.sessions.get(request.request_id)
        if state is None or state.control_fold or state.consolidation == "rotate":
            return False  # a rotation costs no step: nothing to move off the chunk's path
        computed = int(request.num_computed_tokens)
        cursor = state.history.next_position() + max(0, computed - state.history.num_tokens)
        cursor += state.position_excess + state.pending_excess
        return idle_consolidation_due(cursor, state.largest_incoming, state.max_position)

    def step_cap(self, request: Any, num_computed_tokens: int, num_new_tokens: int) -> int:
        """Tokens to schedule this step: a re-prefill runs in pieces of repeating sizes."""
        state = self.sessions.get(request.request_id)
        if state is None or self.reprefill_piece == 0 or num_new_tokens <= 0:
            return num_new_tokens
        remaining = state.reprefill_end - num_computed_tokens
        if remaining <= 0:
            return num_new_tokens
        return min(num_new_tokens, reprefill_piece(remaining, self.reprefill_piece))

    def _drop_remnants(
        self, request: Any, state: SessionRetentionState, history: SessionHistory
    ) -> SessionHistory:
        """Before a re-prefill: remove every remnant's tokens (any width: all blocks go anyway)."""
        ranges: list[tuple[int, int]] = []
        for seg in history.segments:
            if not seg.remnant:
                continue
            if ranges and ranges[-1][1] == seg.start:
                ranges[-1] = (ranges[-1][0], seg.end)
            else:
                ranges.append((seg.start, seg.end))
        for start, end in reversed(ranges):
            self._compact_request(request, start, end, state)
        return apply_eviction(history, ranges) if ranges else history

    def _compact_request(
        self, request: Any, start: int, end: int, state: SessionRetentionState | None = None
    ) -> None:
        released = self.rewrite.compact(request, start, end)
        if state is not None:
            state.encoder_entries_released += released

    def on_encoder_inputs_scheduled(self, scheduled: dict[str, list[int]]) -> None:
        for request_id, input_ids in scheduled.items():
            state = self.sessions.get(request_id)
            if state is not None:
                state.encoder_inputs_scheduled += len(input_ids)

    # -- introspection

    def summary(self, request: Any) -> dict[str, Any]:
        """The counters only, cheap enough for every frame (the server reports them per reply)."""
        return summary(self.sessions[request.request_id])

    def describe(self, request: Any) -> dict[str, Any]:
        """`summary` plus per-token detail, for tests and benchmarks."""
        return describe(self.sessions[request.request_id], request)
