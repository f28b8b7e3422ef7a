"""`RealtimeSessionScheduler`: the one scheduler vllm-realtime runs (`scheduler_cls`).

Why one class, and this name. vLLM takes exactly one scheduler class per engine, and what
`serve` needs from it is one thing: to schedule *realtime sessions*, streaming-input requests
that live as long as a connection, next to vLLM's plain requests. The class is named for that,
not for one of its parts: it hardens every streaming session, bounds the ones that ask for a
retention budget, gives every chunk its own grammar, and passes plain requests through. It is
the class `serve` selects (realtime/engine.py) and the class the benchmarks time
(bench/engine_timing.py subclasses it only to add timers). It replaces a chain of three
subclasses (`RetentionScheduler` → `BoundedSessionScheduler` → `ChunkGrammarScheduler`), where
each override called the next through `super()` and a reader had to walk three files to learn
in which order a fold's steps ran; mixins would keep that chain under other names. Here the
parts are plain collaborators and the order is written once, in the override.

Theory of operation
===================

The class overrides each vLLM scheduler hook it needs exactly once, and each override is a short
sequence of calls into its parts, in the order they must happen. The parts know nothing of each
other:

* `guards` (`stream_guards.StreamingGuards`): late chunks never resurrect a session; a fold past
  max_model_len ends the session with an error instead of killing the engine; the error
  outputs they owe are delivered at the end of the next step.
* `retention` (`eviction.SessionRetention`): bounded sessions. A new resumable request whose
  first chunk carries a budget becomes one (or is refused, through the guards' error path, where
  this engine cannot bound it: `retention_refusal`); every fold records, evicts and maybe
  consolidates; re-prefills are cut into pieces; a preemption resumes as a consolidation.
* chunk grammars (`chunk_grammar`): every fold installs the chunk's own structured-output grammar.
* session reports: every output that closes a chunk of a bounded session, or of a session that
  asks for one (`policy.REPORT_KEY`: the server's sessions all do), carries a
  `retention.records.SessionReport` (blocks held, tokens in context, retention counters), so
  the server reads the session's state from the reply itself.

Requests that are not streaming sessions touch none of the parts but a tag test in
`add_request` and one dict lookup in the hooks retention uses. A plain streaming session (no
budget, no report asked) gets the guards and the chunk grammars, and its outputs are vLLM's
own: no report. The mRoPE position function (`mrope.chunk_position_function`) is bound at the
first bounded session, so an engine that never bounds one never builds it. Bounded sessions need the worker
hooks (positions, mRoPE, preemption resume): the V1 ones patch vLLM's V1 GPU model runner, the
V2 ones are our worker's runner subclass (v2/). Where tests have not executed the hooks on the
engine's runner of this vLLM (the capability record's `serving_refusal`), the engine refuses
to start, naming why (`check_serving_support`); it logs what was executed where it starts.
`requires_worker_hooks = False` is for tests that drive the scheduler alone, with no worker
(tests/retention/test_scheduler_compat.py); `chunk_grammars = False` for the benchmark's
old-path comparison.

Settings: the engine's default consolidation mode and re-prefill piece come from our settings in
the engine's config (`settings.realtime_settings`: `serve --consolidation`,
`--reprefill-piece`); an engine vllm-realtime did not configure gets the defaults.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, ClassVar

from vllm.platforms import current_platform
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus, StreamingUpdate

from retention.policy import REPORT_KEY, REQUEST_ARGS_KEY, SNAPSHOT_KEY
from retention.records import RETENTION_UNSUPPORTED, RetentionCounters, SessionReport
from retention.vllm_adapter import check_serving_support
from retention.vllm_adapter.capabilities import vllm_capabilities
from retention.vllm_adapter.chunk_grammar import install_chunk_grammar_update, take_chunk_grammar
from retention.vllm_adapter.eviction import (
    DEFAULT_REPREFILL_PIECE,
    RetentionConfigError,
    SessionRetention,
    consolidation_mode,
)
from retention.vllm_adapter.kv_rotation import rotation_supported
from retention.vllm_adapter.model_families import model_config_problem
from retention.vllm_adapter.mrope import chunk_position_function
from retention.vllm_adapter.settings import (
    CONSOLIDATION_KEY,
    REPREFILL_PIECE_KEY,
    realtime_settings,
)
from retention.vllm_adapter.stream_guards import StreamingGuards

# Under vLLM's logger: in EngineCore only vLLM's tree has a handler (vllm/logger.py).
log = logging.getLogger(f"vllm.{__name__}")


def model_max_position(model_config: Any) -> int:
    """The model's trained RoPE position range, else max_model_len (also the server's limit)."""
    text_config = model_config.hf_text_config
    trained = getattr(text_config, "max_position_embeddings", None)
    return int(trained) if trained else int(model_config.max_model_len)


# vLLM is imported with follow_imports=skip, so its classes are Any to mypy.
class RealtimeSessionScheduler(Scheduler):  # type: ignore[misc]
    """vLLM's Scheduler composed with the session parts described in the module docstring."""

    requires_worker_hooks: ClassVar[bool] = True
    chunk_grammars: ClassVar[bool] = True
    """False leaves the chunk-grammar part out: only for the benchmark's old-path comparison
    (bench/engine_timing.py), which times the composition that ran before #38."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        capabilities = vllm_capabilities()
        # The runner this engine's workers run (0.32/0.33: vLLM's choice; 0.34: V2 only).
        self.model_runner_kind = capabilities.runner_of(self.vllm_config)
        if self.requires_worker_hooks:
            check_serving_support(self.model_runner_kind)
            log.info(
                "bounded sessions on vLLM %s's %s model runner: %s",
                capabilities.version,
                self.model_runner_kind.upper(),
                capabilities.hooks_executed(self.model_runner_kind),
            )
        self.guards = StreamingGuards()
        # Why this engine cannot bound sessions (None: it can); checked per budgeted session.
        self._retention_refusal = retention_refusal(self)
        self._uses_mrope = bool(self.vllm_config.model_config.uses_mrope)
        self.retention = new_session_retention(self, uses_mrope=self._uses_mrope)
        if self.chunk_grammars:
            install_chunk_grammar_update()

    # ------------------------------------------------------------------ vLLM's hooks

    def add_request(self, request: Request) -> None:
        if not self.guards.accepts(request, self.requests.get(request.request_id)):
            return
        is_new = request.request_id not in self.requests
        super().add_request(request)
        if is_new and request.request_id in self.requests:
            self._start_retention(request)

    def _update_request_as_session(self, session: Request, update: StreamingUpdate) -> None:
        if self.retention.is_retention_session(session.request_id):
            # A bounded session is checked against what it holds AFTER this fold's eviction
            # (and consolidation), not before: the pre-eviction count refused sessions that fit.
            super()._update_request_as_session(session, update)
            problem = self.retention.after_fold(session)
        else:
            problem = self.guards.length_problem(session, update, int(self.max_model_len))
            if problem is None:
                super()._update_request_as_session(session, update)
        if problem is not None:
            self._end_session_for_length(session, problem)
        if self.chunk_grammars:
            take_chunk_grammar(session, update)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        output = super().schedule(*args, **kwargs)
        if self.retention.sessions and output.scheduled_encoder_inputs:
            self.retention.on_encoder_inputs_scheduled(output.scheduled_encoder_inputs)
        return output

    def _reserve_prefill_lookahead(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int
    ) -> int:
        # vLLM calls this for every request it schedules (running and waiting), last in the
        # computation of its step's tokens: a retention re-prefill is cut into pieces of
        # repeating sizes here (eviction.py, step_cap).
        num_new_tokens = int(
            super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        )
        if self.retention.sessions:
            num_new_tokens = self.retention.step_cap(request, num_computed_tokens, num_new_tokens)
        return num_new_tokens

    def _preempt_request(self, request: Request, *args: Any, **kwargs: Any) -> None:
        super()._preempt_request(request, *args, **kwargs)
        # A preempted bounded session resumes as a consolidation (eviction.py, on_preempted).
        self.retention.on_preempted(request)

    def _free_request(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        self.retention.on_finished(request.request_id)
        return super()._free_request(request, *args, **kwargs)

    def has_requests(self) -> bool:
        # Pending error outputs make EngineCore step once more (an empty step) to deliver them.
        return self.guards.pending or bool(super().has_requests())

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> dict[int, EngineCoreOutputs]:
        outputs: dict[int, EngineCoreOutputs] = super().update_from_output(
            scheduler_output, model_runner_output
        )
        # Only outputs with a finish reason are looked at: a decode step of other requests
        # costs one attribute test each.
        for eco in outputs.values():
            for output in eco.outputs:
                if output.finish_reason is not None and output.kv_transfer_params is None:
                    request = self.requests.get(output.request_id)
                    if request is not None and request.resumable and self._reports_to(request):
                        output.kv_transfer_params = self._session_report(request).to_wire()
        if self.guards.pending:
            # After this step's outputs, so a boundary of the same step reaches the client first.
            self.guards.emit(outputs, self.finish_requests)
        return outputs

    # ------------------------------------------------------------------ the parts' glue

    def _start_retention(self, request: Request) -> None:
        """Make a new request with a retention budget a bounded session, or refuse it."""
        extra = request.sampling_params.extra_args if request.sampling_params else None
        if not extra or REQUEST_ARGS_KEY not in extra:
            return
        problem = self._retention_refusal
        if problem is None and not request.resumable:
            problem = "retention needs a streaming-input (resumable) request"
        if problem is None and self._uses_mrope and request.prompt_token_ids is None:
            problem = "retention for mRoPE models needs token prompts (no prompt embeddings)"
        if problem is None and self._uses_mrope and self.retention.position_function is None:
            problem = self._bind_position_function()
        if problem is None:
            try:
                self.retention.on_new_request(request)
                return
            except (RetentionConfigError, ValueError) as exc:
                problem = str(exc)
        # Refuse clearly, through the same path as the other session errors.
        self.guards.condemn(
            request.request_id, RETENTION_UNSUPPORTED, f"{RETENTION_UNSUPPORTED}: {problem}"
        )

    def _bind_position_function(self) -> str | None:
        """Bind the model's mRoPE position function (first bounded session): None, or why it
        cannot run in the scheduler, which then refuses every bounded session."""
        try:
            self.retention.position_function = chunk_position_function(
                self.vllm_config.model_config
            )
        except Exception as exc:  # a model whose function needs more than its config
            self._retention_refusal = f"the model's mRoPE position function failed: {exc!r}"
            return self._retention_refusal
        return None

    def _reports_to(self, request: Request) -> bool:
        """Whether `request`'s chunk boundaries carry a session report."""
        if self.retention.is_retention_session(request.request_id):
            return True
        extra = request.sampling_params.extra_args if request.sampling_params else None
        return bool(extra and extra.get(REPORT_KEY))

    def _end_session_for_length(self, session: Request, why: str) -> None:
        """Park the session (never runnable again) and end it with an error after this step."""
        if session.status != RequestStatus.WAITING_FOR_STREAMING_REQ:
            # Called from _handle_stopped_request: park instead of folding, so that vLLM's
            # _enqueue_waiting_request right after this treats it as blocked, never runnable.
            session.status = RequestStatus.WAITING_FOR_STREAMING_REQ
            self.num_waiting_for_streaming_input += 1
        self.guards.condemn_for_length(session.request_id, why)

    def _session_report(self, request: Request) -> SessionReport:
        """What a live session holds now (at its chunk boundary)."""
        managers = self.kv_cache_manager.coordinator.single_type_managers
        held = sum(
            1
            for m in managers
            for block in m.req_to_blocks.get(request.request_id, ())
            if not block.is_null
        )
        bounded = self.retention.is_retention_session(request.request_id)
        report = SessionReport(
            kv_blocks_held=held,
            tokens_in_context=int(request.num_computed_tokens),
            retention=self._retention_counters(request) if bounded else None,
        )
        extra = request.sampling_params.extra_args if request.sampling_params else None
        if bounded and extra and extra.get(SNAPSHOT_KEY):
            # Only sessions kept in a session store ask: it costs the window's token ids.
            report = replace(report, snapshot=self.retention.snapshot(request))
        return report

    def _retention_counters(self, request: Request) -> RetentionCounters:
        summary = self.retention.summary(request)
        control = self.retention.sessions[request.request_id].control_fold
        return RetentionCounters(
            # The chunk just answered (and its reply) is not a history segment yet: it becomes
            # one at the next fold, but it is in the cache all the same. A control chunk
            # (idle consolidation) answers nothing and is not in the cache.
            chunks_retained=int(summary["chunks_retained"]) + (0 if control else 1),
            chunks_evicted=int(summary["chunks_evicted"]),
            evictions=int(summary["evictions"]),
            consolidations=int(summary["consolidations"]),
            consolidate_when_idle=self.retention.idle_consolidation_due(request),
        )


def retention_refusal(scheduler: Any) -> str | None:
    """Why `scheduler`'s engine cannot bound sessions (None: it can). Sessions of a family no
    oracle test covers are refused, never run on a guess; the family's name and reason come
    first (a hybrid family also fails the groups check)."""
    vllm_config = scheduler.vllm_config
    groups = scheduler.kv_cache_config.kv_cache_groups
    problem = model_config_problem(vllm_config.model_config)
    if problem is not None:
        return str(problem)
    if len(groups) != 1:
        return (
            f"{len(groups)} KV-cache groups (hybrid model): one token range cannot be "
            "freed across groups of different block sizes"
        )
    if scheduler.scheduler_config.async_scheduling:
        return "async scheduling (a chunk must be folded only when complete)"
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        return "pipeline parallelism"
    capabilities = vllm_capabilities()
    if capabilities.runner_of(vllm_config) == "v2":
        # The V2 hooks live in our worker's runner (retention/vllm_adapter/v2/worker.py), for the families ported.
        from retention.vllm_adapter.v2 import v2_retention_refusal

        v2_problem = v2_retention_refusal(vllm_config)
        if v2_problem is not None and capabilities.serving_refusal("v1") is None:
            return f"{v2_problem}; set VLLM_USE_V2_MODEL_RUNNER=0 for the V1 runner"
        if v2_problem is not None:
            return v2_problem
    mm_config = vllm_config.model_config.multimodal_config
    if mm_config is not None and mm_config.is_multimodal_pruning_enabled():
        return "multimodal pruning (EVS recomputes mRoPE positions at every step)"
    return None


def new_session_retention(scheduler: Any, *, uses_mrope: bool) -> SessionRetention:
    """The retention part for `scheduler`'s engine, with the engine's settings."""
    vllm_config = scheduler.vllm_config
    model_config = vllm_config.model_config
    settings = realtime_settings(vllm_config) or {}
    groups = scheduler.kv_cache_config.kv_cache_groups
    block_size = groups[0].kv_cache_spec.block_size if groups else scheduler.block_size
    return SessionRetention(
        scheduler.kv_cache_manager,
        int(block_size),
        model_max_position(model_config),
        max_model_len=int(scheduler.max_model_len),
        uses_mrope=uses_mrope,
        # mRoPE: the model's own position function, which measures how far a chunk's positions
        # outgrow its tokens (Qwen2.5-VL's clips) for the consolidation cursor, is bound at the
        # first bounded session (`RealtimeSessionScheduler._bind_position_function`).
        encoder_cache_manager=getattr(scheduler, "encoder_cache_manager", None),
        rotation_supported=current_platform.is_cpu()
        and rotation_supported(model_config, str(vllm_config.cache_config.cache_dtype)),
        reprefill_piece=int(settings.get(REPREFILL_PIECE_KEY, DEFAULT_REPREFILL_PIECE)),
        default_consolidation=consolidation_mode(settings.get(CONSOLIDATION_KEY)),
    )
