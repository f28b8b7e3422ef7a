"""vLLM's own scheduler, KV cache manager and front end, driven without a model runner.

The compat tests (`pytest -m compat`, `make compat`) run on every supported vLLM, including
releases whose model runner cannot run here. What they exercise is vLLM's code, not a copy:

* `make_scheduler` builds a real `Scheduler` subclass (ours) over a real `VllmConfig` of an
  embedded model (only its config is read: no weights, no tokenizer) and a KV pool of plain
  full-attention blocks, as vLLM's own scheduler tests do;
* `FakeModel` stands in for the model runner: every request that completes its prompt in a step
  samples one token, a deterministic function of the tokens it has (so runs are repeatable);
* `FakeEngineCore` is the EngineCore loop (add, abort, step, outputs) around such a scheduler,
  with the interface `AsyncLLM` uses, so `make_async_llm` gives vLLM's real `AsyncLLM` front end
  (input processor, output processor, collectors, our streaming hardening) over it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.engine import EngineCoreOutputs, EngineCoreRequest
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from realtime.models import model_dir
from retention.vllm_adapter.session_scheduler import RealtimeSessionScheduler
from retention.vllm_adapter.v2 import CPU_WORKER_CLS

init_none_hash(sha256)

MODEL = "smollm2-135m-instruct"  # a Llama config (1D RoPE); only its config.json is read


@contextlib.contextmanager
def _scheduler_only_platform() -> Iterator[None]:
    # vLLM 0.34's x86 CPU platform refuses any config without triton-cpu, which only its model
    # runner uses; nothing here runs a model. Earlier releases never look at it.
    with mock.patch("vllm.triton_utils.HAS_TRITON", True):
        yield


def make_vllm_config(
    *, block_size: int, num_blocks: int, max_model_len: int = 1024, prefix_caching: bool = True
) -> VllmConfig:
    model_config = ModelConfig(
        model=str(model_dir(MODEL)),
        dtype="float32",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=max(max_model_len, 256),
        max_model_len=max_model_len,
        is_encoder_decoder=False,
    )
    cache_config = CacheConfig(
        block_size=block_size, cache_dtype="auto", enable_prefix_caching=prefix_caching
    )
    cache_config.num_gpu_blocks = num_blocks
    with _scheduler_only_platform():
        config = VllmConfig(
            model_config=model_config, scheduler_config=scheduler_config, cache_config=cache_config
        )
    # The worker serve names where the engine runs V2 (0.34: always): these engines stand for
    # serve's, and a V2 engine of any other worker refuses bounded sessions.
    config.parallel_config.worker_cls = CPU_WORKER_CLS
    return config


def make_scheduler(
    cls: type[Any],
    *,
    block_size: int = 16,
    num_blocks: int = 64,
    max_model_len: int = 1024,
    prefix_caching: bool = True,
    additional_config: dict[str, Any] | None = None,
) -> Any:
    config = make_vllm_config(
        block_size=block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        prefix_caching=prefix_caching,
    )
    if additional_config is not None:
        # What realtime/engine.py passes vLLM as `additional_config` (our settings).
        config.additional_config = additional_config
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layer.0"],
                FullAttentionSpec(
                    block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
                ),
            )
        ],
    )
    return cls(
        vllm_config=config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
        log_stats=False,
    )


def block_hasher(scheduler: Any) -> Any:
    return get_request_block_hasher(scheduler.block_size, sha256)


def sampled_token(request: Request) -> int:
    """The fake model's next token: depends only on the tokens the request holds."""
    tokens = request.all_token_ids
    return 1000 + (sum(tokens[-4:]) + len(tokens)) % 997


_RUNNER_OUTPUT_FIELDS = {f.name for f in dataclasses.fields(ModelRunnerOutput)}


class FakeModel:
    """The model runner's place: one sampled token per request whose prompt is complete."""

    def __init__(self) -> None:
        self.scheduled_tokens: list[dict[str, int]] = []

    def run(self, scheduler: Any, scheduler_output: Any) -> ModelRunnerOutput:
        num_scheduled = dict(scheduler_output.num_scheduled_tokens)
        self.scheduled_tokens.append(num_scheduled)
        req_ids = list(num_scheduled)
        sampled: list[list[int]] = []
        for req_id in req_ids:
            request = scheduler.requests[req_id]
            # `schedule` already advanced num_computed_tokens by this step's tokens.
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([sampled_token(request)] if done else [])
        kwargs: dict[str, Any] = {"req_ids": req_ids, "sampled_token_ids": sampled}
        if "req_id_to_index" in _RUNNER_OUTPUT_FIELDS:
            kwargs["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
        return ModelRunnerOutput(**kwargs)


def step(scheduler: Any, model: FakeModel) -> tuple[Any, dict[int, EngineCoreOutputs]]:
    """One engine step: schedule, 'run', update. Returns the scheduler output and outputs."""
    scheduler_output = scheduler.schedule()
    outputs = scheduler.update_from_output(scheduler_output, model.run(scheduler, scheduler_output))
    return scheduler_output, outputs


def add(scheduler: Any, request: EngineCoreRequest) -> None:
    """What EngineCore does with an arriving request (no multimodal inputs here)."""
    scheduler.add_request(Request.from_engine_core_request(request, block_hasher(scheduler)))


class FakeEngineCore:
    """The part of `EngineCoreClient` that `AsyncLLM` uses, around a real scheduler."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.model = FakeModel()
        self.resources = SimpleNamespace(engine_dead=False)
        self.engine_status = {"status": "healthy"}
        self.added: list[EngineCoreRequest] = []
        self._outputs: asyncio.Queue[EngineCoreOutputs] = asyncio.Queue()
        self._wake = asyncio.Event()
        self._loop: asyncio.Task[None] | None = None

    async def get_supported_tasks_async(self) -> tuple[str, ...]:
        return ("generate",)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self.added.append(request)
        add(self.scheduler, request)
        self._kick()

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self._kick()

    def abort_from_engine(self, request_id: str) -> None:
        """An engine-initiated abort (pause, shutdown, fault handling): an ABORT output."""
        from vllm.v1.engine import EngineCoreOutput, FinishReason

        self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        output = EngineCoreOutput(
            request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ABORT
        )
        self._outputs.put_nowait(EngineCoreOutputs(outputs=[output]))

    async def get_output_async(self) -> EngineCoreOutputs:
        return await self._outputs.get()

    def _kick(self) -> None:
        if self._loop is None or self._loop.done():
            self._loop = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            # Step while a step does anything: a parked session (waiting for its next chunk)
            # is a request too, but schedules nothing and emits nothing.
            while self.scheduler.has_requests():
                scheduler_output, outputs = step(self.scheduler, self.model)
                for eco in outputs.values():
                    eco.timestamp = time.monotonic()
                    self._outputs.put_nowait(eco)
                await asyncio.sleep(0)  # let the front end read and send the next chunk
                if not scheduler_output.total_num_scheduled_tokens and not outputs:
                    break
            await self._wake.wait()

    def shutdown(self, timeout: float | None = None) -> None:
        if self._loop is not None:
            self._loop.cancel()


def make_async_llm(scheduler: Any) -> tuple[Any, FakeEngineCore]:
    """vLLM's AsyncLLM front end over a FakeEngineCore running `scheduler`."""
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core_client import EngineCoreClient

    core = FakeEngineCore(scheduler)
    with (
        mock.patch.object(EngineCoreClient, "make_async_mp_client", return_value=core),
        _scheduler_only_platform(),
    ):
        engine = AsyncLLM(
            scheduler.vllm_config,
            executor_class=object,  # never built: the engine core is the fake
            log_stats=False,
            log_requests=False,
        )
    return engine, core


# A chunk of 31 tokens plus the one reply token a fold keeps (max_tokens 2, the last sampled
# token is dropped) is one 32-token segment: two whole blocks, so eviction frees whole chunks.
CHUNK = 31


class SchedulerOnly(RealtimeSessionScheduler):
    """The scheduler half alone: no worker here to need the worker hooks."""

    requires_worker_hooks = False


def chunk_tokens(i: int) -> list[int]:
    return [100 + 40 * i + k for k in range(CHUNK)]


BUDGET = {"sink_chunks": 1, "window_chunks": 2, "consolidation": "reprefill"}
