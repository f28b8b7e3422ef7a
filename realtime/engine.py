"""Start one vLLM AsyncLLM for the server, with the settings this design needs.

Start-up guards live here: configurations that cannot serve bounded streaming sessions fail at
start with a clear message instead of at the first session.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from realtime.models import resolve_model
from retention.vllm_adapter.shm_prefault import PREFAULT_BYTES_PER_CHUNK

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM


CPU_DEFAULT_BLOCK_SIZE = 32
"""KV block size on the CPU build when none is given (vLLM's own CPU default is 128). Eviction
frees whole blocks, so a window is honoured to within one block: 32 tokens, the smallest the CPU
attention backend takes, keeps a video window of 36-token frames within a frame of its size
(measured in docs/benchmarks.md, "Tail latency")."""


class EngineConfigError(RuntimeError):
    """A requested engine configuration that bounded streaming sessions cannot work with."""


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def prepare_process_env() -> None:
    """Environment vLLM needs on this kind of machine; set before vLLM is imported."""
    if not _has_cuda():
        # "auto" binds the worker to core 0 and reserves the others; on small machines that
        # starves the server. nobind lets the OS schedule.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind":
            os.environ.setdefault("OMP_NUM_THREADS", str(cpu_worker_threads()))
        # One malloc arena in the engine processes (read by glibc when they start): the worker's
        # slow anonymous creep lives in per-thread arenas, which glibc trims only from their top.
        # A/B in one run, 3,000 bounded text frames: RSS slope 1.163 -> 0.536 MiB per 1k frames,
        # p99/p50 1.379 -> 1.299; video unchanged (docs/benchmarks.md, "The allocator").
        os.environ.setdefault("MALLOC_ARENA_MAX", "1")
    # vLLM's step ring: chunks no larger than the part of them made resident at start-up
    # (retention/vllm_adapter/shm_prefault.py), so the worker's memory does not step up as
    # larger steps arrive; a larger step goes through vLLM's overflow socket instead.
    os.environ.setdefault("VLLM_MQ_MAX_CHUNK_BYTES_MB", str(PREFAULT_BYTES_PER_CHUNK >> 20))


def cpu_worker_threads() -> int:
    """OpenMP threads for the CPU worker: one core fewer than this process may use. With a
    thread on every core, the front end's and EngineCore's own threads preempt one, and every
    OpenMP barrier of the model step waits for it: on 2 cores a frame's steps then vary 2-4x
    (docs/benchmarks.md, "Worker threads"). An operator's OMP_NUM_THREADS is kept."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count() or 1
    return max(1, usable - 1)


@dataclass(frozen=True)
class EngineSettings:
    """What the server passes to vLLM; one frozen object instead of many keywords."""

    model: str
    max_model_len: int = 2048
    # The CPU worker sizes KV from the NUMA node and refuses to start on small machines unless a
    # size is given; a few MiB per session is plenty for the embedded models.
    kv_cache_memory_bytes: int | None = 256 << 20
    block_size: int | None = None
    max_num_seqs: int = 32
    dtype: str = "auto"
    seed: int = 0
    enforce_eager: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def with_overrides(self, **kwargs: Any) -> EngineSettings:
        return replace(self, **kwargs)


def build_engine_args(settings: EngineSettings) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs

    extra = dict(settings.extra)
    # Guards: fail fast on what the session layer cannot serve.
    if int(extra.get("pipeline_parallel_size", 1) or 1) != 1:
        raise EngineConfigError("pipeline parallelism is not supported for streaming sessions")
    if int(extra.pop("api_server_count", 1) or 1) != 1:
        raise EngineConfigError(
            "several API-server processes are not supported: the session registry lives in "
            "one process (run replicas behind a session-affine router instead)"
        )
    if extra.get("async_scheduling"):
        raise EngineConfigError(
            "async scheduling is not supported: a session's next chunk is folded in only after "
            "the previous chunk's output is final"
        )
    if extra.get("mm_processor_cache_gb", 0):
        raise EngineConfigError(
            "the multimodal processor cache must stay off: an identical later frame would hit a "
            "data-less cache entry whose KV was evicted"
        )
    if not _has_cuda() and settings.block_size is not None and settings.block_size % 32:
        raise EngineConfigError(
            "the CPU attention backend needs a block size that is a multiple of 32"
        )
    kwargs: dict[str, Any] = dict(
        model=resolve_model(settings.model),
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        dtype=settings.dtype,
        seed=settings.seed,
        enforce_eager=settings.enforce_eager,
        mm_processor_cache_gb=0,
        async_scheduling=False,
        disable_log_stats=True,
        # BoundedSessionScheduler plus per-chunk grammars (retention/vllm_adapter/chunk_grammar.py).
        scheduler_cls="retention.vllm_adapter.chunk_grammar.ChunkGrammarScheduler",
        # Structured replies (realtime/structured.py) with xgrammar, in compact JSON: vLLM's xgrammar backend
        # reads this engine-wide flag, not the request's; with free whitespace the tiny VLM
        # padded every reply with newlines until max_tokens.
        structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
    )
    if settings.kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = settings.kv_cache_memory_bytes
    if settings.block_size is not None:
        kwargs["block_size"] = settings.block_size
    elif not _has_cuda():
        kwargs["block_size"] = CPU_DEFAULT_BLOCK_SIZE
    kwargs.update(extra)
    args = AsyncEngineArgs(**kwargs)
    return args


def start_engine(settings: EngineSettings) -> AsyncLLM:
    """Start AsyncLLM (EngineCore runs in its own process)."""
    prepare_process_env()
    from retention.vllm_adapter import check_vllm_version

    check_vllm_version()
    from vllm.v1.engine.async_llm import AsyncLLM

    args = build_engine_args(settings)
    if args.data_parallel_size and int(args.data_parallel_size) > 1:
        raise EngineConfigError(
            "data parallelism inside one server is not supported (see docs/scale-out)"
        )
    return AsyncLLM.from_engine_args(args)
