"""Worker-side mRoPE positions for retention sessions (vLLM 0.32 model runner).

Theory of operation
===================
mRoPE models (Qwen2-VL family) rotate each token at a 3-D position (temporal, height, width).
The model runner keeps one ``3 × num_prompt_tokens`` tensor per request
(``CachedRequestState.mrope_positions``) built by the model's ``get_mrope_input_positions``, and
decode tokens get ``cache index + mrope_position_delta`` in all three rows
(``MRotaryEmbedding.get_next_input_positions_tensor``). The KV slot of a token is its cache
index, computed separately, so mRoPE positions are already apart from cache slots.

Stock vLLM rebuilds that tensor over the WHOLE accumulated prompt at every chunk fold
(``_update_streaming_request`` calls ``_init_mrope_positions``): O(N) per chunk, and after an
in-place eviction it would renumber the survivors as if the evicted tokens had never been
there, while their cached K was rotated at the old positions. Instead, for a retention session
the tensor is *maintained*:

* held columns: the old prompt's columns, plus the decode tokens vLLM keeps (at ``index +
  delta``), minus the columns of the cache ranges the scheduler evicted at this fold;
* the chunk just folded in: ``get_mrope_input_positions`` over the chunk ALONE (its own tokens
  and multimodal features, offsets made chunk-local), shifted to start at (max held position +
  1) — exactly what the stock computation over the uncompacted history gives it, because a
  chunk's positions only depend on the positions before it through that maximum;
* ``mrope_position_delta = max position + 1 - num_prompt_tokens``, so decode tokens after a
  compaction continue right after the chunk (cache indices shrank, the delta grew).

After a consolidation (the scheduler's self-preempting re-prefill) the stock computation runs
once over the compacted prompt: the survivors are renumbered as a fresh prefill.

Scheduler/worker protocol (they cannot drift silently). At every fold the scheduler
(``eviction.py``) sends a :class:`~retention.vllm_adapter.fold_control.FoldControl`: a fold
sequence number, the number of tokens the cache held before this fold's eviction, the ranges
evicted at this fold (in those pre-eviction coordinates) and whether the request is being
re-prefilled. The worker checks the record (``accept_fold``: version, sequence, preemptions),
that the old tensor covers the previous prompt, and that held columns == the new
``num_computed_tokens``; any mismatch raises :class:`MRopeSyncError` or ``FoldControlError``
(loud, instead of wrong positions). Requests without the record take the stock path.

The patch wraps ``GPUModelRunner._init_mrope_positions`` (called for a new request and for each
streaming update, after the cached state got the new prompt, features and computed count);
installed from ``plugin.register`` through an import hook, idempotent. Not supported (refused by
the scheduler): prompt embeddings, multimodal pruning (EVS recomputes positions per step).

Position bound (scheduler side). The scheduler's 1D cursor counts tokens. That bounds the
mRoPE positions from above only where a chunk's positions never outgrow its token count (Qwen2-VL,
Qwen3-VL: an image or clip of t×h×w tokens advances max(t, h, w)). Qwen2.5-VL scales a clip's
temporal positions by ``second_per_grid_ts × tokens_per_second``: a clip of few tokens can span
many positions. So at every fold the scheduler runs the model's own ``get_mrope_input_positions``
over the incoming chunk alone (:func:`chunk_position_function`, the call the worker makes) and
takes each item's *excess*, the positions its placeholders span beyond their count
(:func:`position_excess`); the consolidation decision adds the excess of every chunk computed
since the last re-prefill (and of the survivors of that re-prefill) to the token cursor, so it
bounds the largest position the tensor holds (eviction.py).

Status (vLLM 0.32; tiny Qwen2-VL, Qwen2.5-VL, Qwen3-VL: tests/retention/test_video_retention.py,
test_mrope.py, test_mrope_families.py)
----------------------------------------------------------------------------------------
Works: in-place eviction of image and clip chunks, decode after a compaction, consolidation
(with and without the encoder having to rerun on the surviving frames), concurrent sessions,
1,000-frame endurance with bounded KV blocks, encoder-cache entries and mRoPE columns, Qwen3-VL's
interleaved sections and deepstack (nothing position-related: the chunk-local computation
shifted by max + 1 equals the stock one, its frames' timestamps are text tokens of the chunk),
Qwen2.5-VL's temporal scaling (the bound above). Checked against a dense transformers forward
with transformers' own 3-D positions: max |Δ logprob| ~1e-6 (tolerance 1e-4). The V2 model runner
keeps positions in its own state (``RopeState``): its hooks (``v2/worker.py``) reuse this
module's pure functions. Not covered: async scheduling and pipeline parallelism (refused). The
excess bound assumes one multimodal item per chunk or items whose excess is >= 0 (the service
sends one frame or clip per chunk): a remnant of a chunk holding an item of negative excess and
one of positive excess could, after a preemption, span more than its chunk's recorded excess.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from types import ModuleType
from typing import Any, Final

from retention.vllm_adapter.fold_control import (
    FoldControl,
    FoldControlError,
    accept_fold,
    fold_control_of,
    note_resume,
)
from retention.vllm_adapter.heap_trim import release_after_consolidation
from retention.vllm_adapter.import_hooks import patch_on_import

_RUNNER_MODULE: Final = "vllm.v1.worker.gpu_model_runner"
_PATCHED: Final = "_vllm_realtime_mrope_patched"
_STOCK_INIT: Final = "_vllm_realtime_stock_init_mrope_positions"


class MRopeSyncError(FoldControlError):
    """The worker's mRoPE positions and the scheduler's fold control disagree."""


# --------------------------------------------------------------------------- pure tensor ops


def held_positions(
    old_positions: Any, old_delta: int, held_before: int, evicted: Sequence[tuple[int, int]]
) -> Any:
    """The ``3 × held`` positions the cache holds after this fold's eviction.

    ``old_positions`` covers the previous prompt (``3 × P``); the ``held_before - P`` tokens after
    it are the previous chunk's decoded tokens at ``index + old_delta``; ``evicted`` are disjoint
    ``[a, b)`` ranges of ``[0, held_before)`` whose columns are dropped.
    """
    import torch

    num_old = int(old_positions.shape[1])
    if held_before < num_old:
        raise MRopeSyncError(
            f"the cache held {held_before} tokens before the fold, fewer than the previous "
            f"prompt's {num_old} positions"
        )
    parts = [old_positions]
    if held_before > num_old:
        decoded = torch.arange(num_old, held_before, dtype=old_positions.dtype) + int(old_delta)
        parts.append(decoded.expand(old_positions.shape[0], -1))
    full = torch.cat(parts, dim=1) if len(parts) > 1 else old_positions
    if not evicted:
        return full
    keep = torch.ones(held_before, dtype=torch.bool)
    prev_end = 0
    for a, b in sorted(evicted):
        if not prev_end <= a < b <= held_before:
            raise MRopeSyncError(
                f"evicted range [{a}, {b}) is not a disjoint part of [0, {held_before})"
            )
        keep[a:b] = False
        prev_end = b
    return full[:, keep]


def appended_positions(held: Any, chunk_positions: Any | None) -> tuple[Any, int]:
    """``held`` followed by the chunk's local positions shifted to (max held + 1); the delta."""
    import torch

    start = int(held.max()) + 1 if held.shape[1] else 0
    if chunk_positions is None or chunk_positions.shape[1] == 0:
        positions = held
    else:
        positions = torch.cat([held, chunk_positions.to(held.dtype) + start], dim=1)
    top = int(positions.max()) + 1 if positions.shape[1] else 0
    return positions.contiguous(), top - int(positions.shape[1])


def position_excess(positions: Any, features: Sequence[Any]) -> int:
    """How far a chunk's positions outgrow its token count: the sum, over its items, of the
    positions each item's placeholders span beyond their number (never below 0 per item).

    ``positions`` is the chunk's local ``3 × n`` tensor, ``features`` its items with
    chunk-local offsets. Text advances one position per token, so a chunk's (max position + 1)
    is at most its token count plus this.
    """
    excess = 0
    for feature in features:
        pos = feature.mm_position
        cols = positions[:, pos.offset : pos.offset + pos.length]
        if cols.shape[1] == 0:
            continue
        span = int(cols.max()) - int(cols.min()) + 1
        excess += max(0, span - int(cols.shape[1]))
    return excess


PositionFunction = Callable[[list[int], list[Any]], tuple[Any, int]]


def chunk_position_function(model_config: Any) -> PositionFunction:
    """The model's own ``get_mrope_input_positions``, callable without its weights (in the
    scheduler's process): bound to an instance that was never initialised and holds only the
    model's config, which is all the position functions of vLLM 0.32's Qwen-VL models read."""
    from vllm.model_executor.models.registry import ModelRegistry

    model_cls, _ = ModelRegistry.resolve_model_cls(
        model_config.architectures, model_config=model_config
    )
    positions_only = object.__new__(model_cls)
    # nn.Module.__setattr__ on an instance without its dicts falls through to object's.
    positions_only.config = model_config.hf_config
    function: PositionFunction = positions_only.get_mrope_input_positions
    # Fail when the first bounded session starts, not at its first fold, where a model's
    # function needs more than its config (a family these hooks were not proven on).
    function([0, 1], [])
    return function


def chunk_excess(function: PositionFunction, tokens: list[int], features: Sequence[Any]) -> int:
    """:func:`position_excess` of a chunk (its tokens, its items with chunk-local offsets)."""
    if not features:
        return 0  # text only: one position per token
    positions, _ = function(tokens, list(features))
    return position_excess(positions, features)


def local_features(features: Sequence[Any], start: int) -> list[Any]:
    """The items at or after ``start`` with offsets made relative to it (a chunk alone)."""
    return _chunk_features(features, start)


# --------------------------------------------------------------------------- the runner patch


def _chunk_features(features: Sequence[Any], held: int) -> list[Any]:
    local = []
    for feature in features:
        if feature.modality == "prompt_embeds":
            continue
        pos = feature.mm_position
        if pos.offset >= held:
            local.append(replace(feature, mm_position=replace(pos, offset=pos.offset - held)))
        elif pos.offset + pos.length > held:
            raise MRopeSyncError(
                f"multimodal item at [{pos.offset}, {pos.offset + pos.length}) straddles the "
                f"{held} held tokens"
            )
    return local


def _extend_positions(runner: Any, req_state: Any, fold: FoldControl) -> None:
    old = req_state.mrope_positions
    if old is None or req_state.mrope_position_delta is None:
        raise MRopeSyncError(f"request {req_state.req_id} has no mRoPE positions to extend")
    if req_state.prompt_token_ids is None:
        raise MRopeSyncError("retention with mRoPE needs token prompts (no prompt embeddings)")
    held = held_positions(old, req_state.mrope_position_delta, fold.held_before, fold.evicted)
    num_held = int(held.shape[1])
    if num_held != req_state.num_computed_tokens:
        raise MRopeSyncError(
            f"request {req_state.req_id}: {num_held} positions held after fold {fold.fold}, but "
            f"the scheduler reports {req_state.num_computed_tokens} computed tokens"
        )
    tokens = req_state.prompt_token_ids
    chunk = None
    if len(tokens) > num_held:
        chunk, _ = runner.get_model().get_mrope_input_positions(
            tokens[num_held:], _chunk_features(req_state.mm_features, num_held)
        )
    positions, delta = appended_positions(held, chunk)
    req_state.mrope_positions = positions
    req_state.mrope_position_delta = delta


def _patch_runner(module: ModuleType) -> None:
    runner_cls = module.GPUModelRunner
    if getattr(runner_cls, _PATCHED, False):
        return
    original = runner_cls._init_mrope_positions

    def _init_mrope_positions(self: Any, req_state: Any) -> None:
        fold = fold_control_of(req_state.sampling_params)
        if fold is None:
            original(self, req_state)
            return
        accept_fold(req_state, fold)
        release_after_consolidation(fold)
        if fold.reset:
            original(self, req_state)  # a fresh prefill: positions over the whole prompt
        else:
            _extend_positions(self, req_state, fold)

    setattr(runner_cls, _STOCK_INIT, original)
    runner_cls._init_mrope_positions = _init_mrope_positions
    setattr(runner_cls, _PATCHED, True)


def reset_after_preemption(runner: Any, req_state: Any) -> None:
    """A resumed retention session is re-prefilled from 0: positions over the whole prompt,
    as a fresh request gets them (eviction.py, on_preempted). Decode tokens after the prompt
    follow from the new delta."""
    getattr(type(runner), _STOCK_INIT)(runner, req_state)
    note_resume(req_state)


def install_mrope_hooks() -> None:
    """Idempotent: patch now if the model runner is loaded, else right after it loads."""
    patch_on_import(_RUNNER_MODULE, _patch_runner)
