"""`BoundedSessionScheduler`: RetentionScheduler (streaming hardening) + bounded sessions.

The engine's scheduler class (`scheduler_cls`, see realtime/engine.py). The mechanics of
eviction, positions and consolidation are in `eviction.py` (and `mrope.py` for the worker's
3-D positions of mRoPE models); this class only routes vLLM's scheduler events to it: a new
resumable request, a chunk fold, a step's scheduled encoder inputs, a request freed. Requests
that did not ask for retention pass straight through (one dict lookup per event).

Its sessions need the worker hooks (positions, mRoPE, preemption resume), which patch vLLM's V1
GPU model runner: on a vLLM without it the engine refuses to start, naming why
(`check_serving_support`). `requires_worker_hooks = False` is for tests that drive the scheduler
alone, with no worker (tests/retention/test_scheduler_compat.py).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, ClassVar

from vllm.platforms import current_platform
from vllm.v1.request import Request, StreamingUpdate

from retention.policy import REQUEST_ARGS_KEY, SNAPSHOT_KEY
from retention.records import RETENTION_UNSUPPORTED, RetentionCounters, SessionReport
from retention.vllm_adapter import check_serving_support
from retention.vllm_adapter.eviction import RetentionConfigError, SessionRetention
from retention.vllm_adapter.kv_rotation import rotation_supported
from retention.vllm_adapter.model_families import model_config_problem
from retention.vllm_adapter.mrope import chunk_position_function
from retention.vllm_adapter.scheduler import RetentionScheduler

logger = logging.getLogger(__name__)


def model_max_position(model_config: Any) -> int:
    """The model's trained RoPE position range, else max_model_len (also the server's limit)."""
    text_config = model_config.hf_text_config
    trained = getattr(text_config, "max_position_embeddings", None)
    return int(trained) if trained else int(model_config.max_model_len)


def _multimodal_pruning(vllm_config: Any) -> bool:
    mm_config = vllm_config.model_config.multimodal_config
    return bool(mm_config is not None and mm_config.is_multimodal_pruning_enabled())


class BoundedSessionScheduler(RetentionScheduler):
    requires_worker_hooks: ClassVar[bool] = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if self.requires_worker_hooks:
            check_serving_support()
        super().__init__(*args, **kwargs)
        groups = self.kv_cache_config.kv_cache_groups
        # Sessions of a family no oracle test covers are refused, never run on a guess; the
        # family's name and reason come first (a hybrid family also fails the groups check).
        self._unsupported = model_config_problem(self.vllm_config.model_config)
        if self._unsupported is not None:
            pass
        elif len(groups) != 1:
            self._unsupported = (
                f"{len(groups)} KV-cache groups (hybrid model): one token range cannot be "
                "freed across groups of different block sizes"
            )
        elif self.scheduler_config.async_scheduling:
            self._unsupported = "async scheduling (a chunk must be folded only when complete)"
        elif self.vllm_config.parallel_config.pipeline_parallel_size > 1:
            self._unsupported = "pipeline parallelism"
        elif getattr(self, "use_v2_model_runner", False):
            # positions.py and mrope.py patch the V1 model runner (GPUModelRunner) only.
            self._unsupported = (
                "the V2 model runner (the position patches target V1); set "
                "VLLM_USE_V2_MODEL_RUNNER=0 (vllm-realtime serve sets it itself)"
            )
        elif _multimodal_pruning(self.vllm_config):
            self._unsupported = "multimodal pruning (EVS recomputes mRoPE positions at every step)"
        self._uses_mrope = bool(self.vllm_config.model_config.uses_mrope)
        block_size = groups[0].kv_cache_spec.block_size if groups else self.block_size
        self.retention = SessionRetention(
            self.kv_cache_manager,
            int(block_size),
            model_max_position(self.vllm_config.model_config),
            max_model_len=int(self.max_model_len),
            uses_mrope=self._uses_mrope,
            # mRoPE: the model's own position function measures how far a chunk's positions
            # outgrow its tokens (Qwen2.5-VL's clips), for the consolidation cursor.
            position_function=(
                chunk_position_function(self.vllm_config.model_config) if self._uses_mrope else None
            ),
            encoder_cache_manager=getattr(self, "encoder_cache_manager", None),
            rotation_supported=current_platform.is_cpu()
            and rotation_supported(
                self.vllm_config.model_config, str(self.vllm_config.cache_config.cache_dtype)
            ),
        )

    def add_request(self, request: Request) -> None:
        is_new = request.request_id not in self.requests
        super().add_request(request)
        if not is_new or request.request_id not in self.requests:
            return
        extra = request.sampling_params.extra_args if request.sampling_params else None
        if not extra or REQUEST_ARGS_KEY not in extra:
            return
        problem = self._unsupported
        if problem is None and not request.resumable:
            problem = "retention needs a streaming-input (resumable) request"
        if problem is None and self._uses_mrope and request.prompt_token_ids is None:
            problem = "retention for mRoPE models needs token prompts (no prompt embeddings)"
        if problem is None:
            try:
                self.retention.on_new_request(request)
                return
            except (RetentionConfigError, ValueError) as exc:
                problem = str(exc)
        # Refuse clearly, through the same path as the other session errors.
        message = f"{RETENTION_UNSUPPORTED}: {problem}"
        logger.warning(message)
        self._session_errors[request.request_id] = (RETENTION_UNSUPPORTED, message)

    def _update_request_as_session(self, session: Request, update: StreamingUpdate) -> None:
        if not self.retention.is_retention_session(session.request_id):
            super()._update_request_as_session(session, update)
            return
        # A bounded session is checked against what it holds AFTER this fold's eviction (and
        # consolidation), not before: the pre-eviction count refused sessions that fit.
        self._fold(session, update)
        problem = self.retention.after_fold(session)
        if problem is not None:
            self._end_session_for_length(session, problem)

    def _session_report(self, request: Request) -> SessionReport:
        report = super()._session_report(request)
        extra = request.sampling_params.extra_args if request.sampling_params else None
        if (
            extra
            and extra.get(SNAPSHOT_KEY)
            and self.retention.is_retention_session(request.request_id)
        ):
            # Only sessions kept in a session store ask: it costs the window's token ids.
            report = replace(report, snapshot=self.retention.snapshot(request))
        return report

    def _retention_counters(self, request: Request) -> RetentionCounters | None:
        if not self.retention.is_retention_session(request.request_id):
            return None
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

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        output = super().schedule(*args, **kwargs)
        if self.retention.sessions and output.scheduled_encoder_inputs:
            self.retention.on_encoder_inputs_scheduled(output.scheduled_encoder_inputs)
        return output

    def _free_request(self, request: Request, *args: Any, **kwargs: Any) -> Any:
        self.retention.on_finished(request.request_id)
        return super()._free_request(request, *args, **kwargs)
