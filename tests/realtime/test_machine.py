"""What `serve` decides from the machine (issue #48): the CPU dtype by its flags, the default KV
pool by what the admitted sessions can reserve, a busy calibration, the per-weight log lines.

The CPU's flags are injected (a /proc/cpuinfo text, or EnginePlatform.flags), so both branches
are tested on any machine, AVX2 or AVX-512 BF16. Pure: no engine.
"""

from __future__ import annotations

import logging

import pytest

from realtime.engine import (
    CPU_KV_MARGIN,
    EnginePlatform,
    EngineSettings,
    build_engine_args,
    choose_dtype,
    cpu_flags,
    default_cpu_kv_bytes,
    kv_bytes_per_token,
    whole_context_blocks,
)
from retention.vllm_adapter.quiet_load import FloatNarrowingFilter

MiB = 1 << 20
GiB = 1 << 30

# Abridged from the two machines of issue #48: an AVX2 EPYC (family 25) and a Zen 4 with
# AVX-512 BF16.
AVX2_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
flags\t\t: fpu vme sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2
"""
ZEN4_CPUINFO = """processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx avx2 avx512f avx512bw avx512vl avx512_bf16 avx512_vnni
"""
AVX2 = EnginePlatform(cuda=False, available_memory=22 * GiB, flags=cpu_flags(AVX2_CPUINFO))
ZEN4 = EnginePlatform(cuda=False, available_memory=22 * GiB, flags=cpu_flags(ZEN4_CPUINFO))


def test_cpu_flags_are_read_from_cpuinfo_text() -> None:
    assert "avx2" in AVX2.flags and "avx512_bf16" not in AVX2.flags
    assert "avx512_bf16" in ZEN4.flags
    assert cpu_flags("processor: 0\n") == frozenset()  # no flags line: nothing native
    assert "amx_bf16" in cpu_flags("flags : avx2 amx_bf16 amx_tile\n")


def test_the_cpu_dtype_is_the_one_the_cpu_does_natively() -> None:
    dtype, line = choose_dtype("auto", AVX2)
    assert dtype == "float32"
    assert line.startswith("dtype: float32, the CPU has no native bf16")
    assert "avx512_bf16/amx_bf16" in line and "--dtype" in line
    dtype, line = choose_dtype("auto", ZEN4)
    assert dtype == "bfloat16" and "native bf16 (avx512_bf16)" in line
    # An explicit --dtype stands on either; a GPU keeps vLLM's choice.
    assert choose_dtype("bfloat16", AVX2) == ("bfloat16", "dtype: bfloat16 (--dtype)")
    assert choose_dtype("float32", ZEN4)[0] == "float32"
    assert choose_dtype("auto", EnginePlatform(cuda=True))[0] == "auto"


def test_serve_passes_the_chosen_dtype_and_says_why_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="realtime.engine"):
        assert build_engine_args(EngineSettings(model="tiny-qwen2-vl"), AVX2).dtype == "float32"
        assert build_engine_args(EngineSettings(model="tiny-qwen2-vl"), ZEN4).dtype == "bfloat16"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dtype:")]
    assert len(lines) == 2
    # --dtype, given as serve's flag or passed through to vLLM, overrides the choice.
    given = EngineSettings(model="tiny-qwen2-vl", dtype="bfloat16")
    assert build_engine_args(given, AVX2).dtype == "bfloat16"
    through = EngineSettings(model="tiny-qwen2-vl", extra={"dtype": "float16"})
    assert build_engine_args(through, ZEN4).dtype == "float16"


def test_serve_on_an_avx2_cpu_builds_the_engine_of_dtype_float32() -> None:
    # So `make run` on an AVX2-only CPU answers as `--dtype float32` does: the same engine.
    chosen = build_engine_args(EngineSettings(model="tiny-qwen2-vl"), AVX2)
    explicit = build_engine_args(EngineSettings(model="tiny-qwen2-vl", dtype="float32"), AVX2)
    assert chosen == explicit
    assert build_engine_args(EngineSettings(model="tiny-qwen2-vl"), ZEN4) != explicit


def test_the_default_pool_holds_what_max_sessions_can_reserve() -> None:
    # The tiny VLM: 2 layers x 2 KV heads x 32 dims x (K, V) = 256 values a token.
    from realtime.models import resolve_model

    path = resolve_model("tiny-qwen2-vl")
    assert kv_bytes_per_token(path, "float32") == 1024
    assert kv_bytes_per_token(path, "bfloat16") == 512
    assert kv_bytes_per_token("some/hub-id", "float32") is None
    assert whole_context_blocks(2048, 32) == 65
    settings = EngineSettings(model="tiny-qwen2-vl", max_sessions=32)
    args = build_engine_args(settings, AVX2)
    need = 32 * 65 * 32 * 1024 * (1 + CPU_KV_MARGIN)
    assert args.kv_cache_memory_bytes == -(-int(need) // MiB) * MiB  # 72 MiB, not 5.5 GiB
    # max_num_seqs caps the sessions the server runs; memory caps the pool.
    fewer = EngineSettings(model="tiny-qwen2-vl", max_sessions=1000, max_num_seqs=8)
    assert (
        build_engine_args(fewer, AVX2).kv_cache_memory_bytes == 32 * MiB
    )  # 8 x 2 MiB, the minimum
    assert default_cpu_kv_bytes(1 * GiB, 10 * GiB) == 256 * MiB
    assert default_cpu_kv_bytes(1 * GiB, 1 * MiB) == 32 * MiB  # the minimum


def test_the_pool_line_names_the_figure(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="realtime.engine"):
        build_engine_args(EngineSettings(model="tiny-qwen2-vl", max_sessions=32), ZEN4)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("engine"))
    assert "KV pool 36 MiB = 32 sessions x 65 blocks (the largest reservation, a whole " in line
    assert "x 16 KiB a block + 10%; --kv-cache-memory-bytes sets it" in line


def test_only_the_float32_narrowing_per_weight_is_dropped() -> None:
    quiet = FloatNarrowingFilter()

    def record(*args: object) -> logging.LogRecord:
        return logging.LogRecord(
            "vllm.model_executor.models.utils", logging.WARNING, "utils.py", 333,
            "Attempted to load weight %s with dtype %s into parameter with dtype %s", args, None,
        )  # fmt: skip

    assert not quiet.filter(record("a.weight", "torch.float32", "torch.bfloat16"))
    assert not quiet.filter(record("b.weight", "torch.float32", "torch.float16"))
    assert quiet.filter(record("c.weight", "torch.float16", "torch.bfloat16"))  # still warns
    other = logging.LogRecord("x", logging.WARNING, "f", 1, "something else", None, None)
    assert quiet.filter(other)
    assert quiet.dropped == 2
