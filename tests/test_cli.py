"""The README's main command, as a user runs it: `vllm-realtime serve` in its own process."""

from __future__ import annotations

import json
import subprocess

import pytest
import websockets

from tests.tools import SERVE as BIN
from tests.tools import served


def test_models_list_shows_the_defaults() -> None:
    out = subprocess.run([str(BIN), "models", "list"], capture_output=True, text=True, check=True)
    assert "smol-qwen2-vl (default)" in out.stdout
    assert "smollm2-135m-instruct" in out.stdout and "built" in out.stdout


def test_engine_guards_refuse_unservable_configs() -> None:
    from realtime.engine import EngineConfigError, EngineSettings, build_engine_args

    for extra in (
        {"async_scheduling": True},
        {"pipeline_parallel_size": 2},
        {"mm_processor_cache_gb": 4},
        {"api_server_count": 2},
    ):
        with pytest.raises(EngineConfigError):
            build_engine_args(EngineSettings(model="tiny-qwen2-vl", extra=extra))


def test_keep_alive_on_engine_death_reads_vllms_variable_as_vllm_does() -> None:
    from realtime.cli import keep_alive_from_env

    assert keep_alive_from_env({}) is False
    for raw, kept in (("0", False), ("", False), ("1", True), (" 1 ", True), ("2", True)):
        assert keep_alive_from_env({"VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": raw}) is kept, raw
    with pytest.raises(SystemExit, match="must be an integer"):
        keep_alive_from_env({"VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "yes"})


def test_cpu_default_block_size_is_32_and_a_given_one_wins() -> None:
    from realtime.engine import CPU_DEFAULT_BLOCK_SIZE, EngineSettings, build_engine_args

    assert CPU_DEFAULT_BLOCK_SIZE == 32
    args = build_engine_args(EngineSettings(model="tiny-qwen2-vl"))
    assert args.block_size == 32
    args = build_engine_args(EngineSettings(model="tiny-qwen2-vl", block_size=128))
    assert args.block_size == 128
    args = build_engine_args(EngineSettings(model="tiny-qwen2-vl", extra={"block_size": 64}))
    assert args.block_size == 64


def test_retention_max_position_must_be_positive() -> None:
    from realtime.config import ServerConfig

    with pytest.raises(ValueError, match="retention_max_position"):
        ServerConfig(retention_max_position=0)
    out = subprocess.run(
        [str(BIN), "serve", "--retention-max-position", "0"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "must be >= 1" in out.stderr
    out = subprocess.run(
        [str(BIN), "serve", "--reprefill-piece", "96"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "must be 0 or a power of two" in out.stderr
    for flag in ("--drain-timeout", "--max-resume-grace"):
        out = subprocess.run([str(BIN), "serve", flag, "-1"], capture_output=True, text=True)
        assert out.returncode == 2 and "must be >= 0" in out.stderr, (flag, out.stderr)


@pytest.mark.slow
async def test_serve_answers_health_and_websocket() -> None:
    # served() also checks that SIGINT drains and exits 0 (realtime/drain.py); it used to
    # re-raise the signal.
    # 64 MiB: the context at float32 (serve's dtype on a CPU without native bf16) needs 41.
    flags = ["--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "1024"]
    async with served(*flags, "--block-size", "32") as port:
        url = f"ws://127.0.0.1:{port}/v1/realtime"
        async with websockets.connect(url, subprotocols=["vllm-realtime"]) as ws:
            hello = json.loads(await ws.recv())
            assert hello["type"] == "session.created"
            assert hello["limits"]["model"] == "smol-qwen2-vl"
