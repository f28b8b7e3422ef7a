"""The plugin touches only engines vllm-realtime started (retention/vllm_adapter/plugin.py).

vLLM runs every `vllm.general_plugins` entry point in every process of every engine in the
environment. A plain `vllm.LLM`, started in a fresh process (engine_probe.py), must show that our
plugin ran there and installed nothing: no utility on EngineCore, no mark on the model runner or
the workers, no module of ours beyond the plugin's own. An engine `vllm-realtime serve` starts,
behind a real server, must carry the hooks and exactly the utilities production calls; the
tests' own engines (introspection) also the utilities tests and benchmarks read. The fast tests
pin how the plugin finds the engine's config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from retention.vllm_adapter import plugin
from retention.vllm_adapter.settings import INTROSPECTION, REALTIME_CONFIG_KEY
from tests.retention.conftest import run_probe
from tests.retention.engine_probe import CORE_UTILITIES, WORKER_UTILITIES

ROOT = Path(__file__).resolve().parents[2]

# What the entry point itself imports: the plugin decides from these alone.
PLUGIN_MODULES = [
    "retention",
    "retention.vllm_adapter",
    "retention.vllm_adapter.errors",
    "retention.vllm_adapter.plugin",
    "retention.vllm_adapter.settings",
    "retention.vllm_adapter.versions",
]


def _config(additional: dict[str, Any]) -> Any:
    """A `VllmConfig` instance carrying only `additional_config` (a full one needs a model)."""
    from vllm.config import VllmConfig

    config = object.__new__(VllmConfig)
    object.__setattr__(config, "additional_config", additional)
    return config


def _load_plugins_with(vllm_config: Any) -> Any:
    """Where vLLM calls the plugins: a frame whose local `vllm_config` is the engine's."""
    assert vllm_config is not None
    return plugin.engine_config_being_started()


def test_the_plugin_finds_the_config_of_the_engine_being_started() -> None:
    ours = _config({REALTIME_CONFIG_KEY: {INTROSPECTION: False}})
    assert _load_plugins_with(ours) is ours


def test_without_an_engine_config_the_plugin_does_nothing(monkeypatch: Any) -> None:
    """A front end building its engine arguments (no config yet), or a plain engine."""
    installed: list[bool] = []
    monkeypatch.setattr(
        plugin,
        "install_engine_process_hooks",
        lambda introspection, vllm_config=None: installed.append(introspection),
    )
    monkeypatch.setattr(plugin, "_registered", False)
    plugin.register()  # no `vllm_config` anywhere up this stack
    plain = _config({})

    def engine_core_init(vllm_config: Any) -> None:
        plugin.register()

    engine_core_init(plain)
    assert installed == [] and not plugin._registered
    engine_core_init(_config({REALTIME_CONFIG_KEY: {INTROSPECTION: True}}))
    assert installed == [True] and plugin._registered


def _probe(*argv: str) -> dict[str, Any]:
    return run_probe("engine_probe", *argv, env={"PYTHONPATH": str(ROOT)}, timeout=600)


@pytest.mark.slow
def test_a_plain_vllm_engine_gets_none_of_our_hooks() -> None:
    from realtime.models import resolve_model

    report = _probe("plain", resolve_model("smollm2-135m-instruct"))
    # EngineCore answers none of our utilities: vLLM reports each as an unknown method.
    assert report["core_utilities"] == dict.fromkeys(CORE_UTILITIES, False)
    # The worker (its own process on the CPU build) and the front end: the entry point ran (its
    # modules are there) and patched nothing: no mark on the runner, WorkerBase, EngineCore.
    assert report["worker"]["pid"] != report["front"]["pid"]
    for side in ("front", "worker"):
        assert report[side]["modules"] == PLUGIN_MODULES, side
        assert report[side]["marked"] == [], side


SERVE_ARGS = (
    "--model",
    "smollm2-135m-instruct",
    "--max-model-len",
    "1024",
    "--kv-cache-memory-bytes",  # the context at float32 (no native bf16) needs 41 MiB
    str(64 << 20),
    "--max-num-seqs",
    "2",
    "--block-size",  # passed through to vLLM, as an operator would
    "32",
)


@pytest.mark.slow
def test_a_serve_engine_has_the_hooks_and_only_the_utilities_production_calls() -> None:
    report = _probe("serve", *SERVE_ARGS)
    assert report["introspection"] is False
    # The product works through a real server: a session's frame answered, KV held.
    done = report["response_done"]
    assert done["status"] in ("completed", "incomplete"), done
    assert done["retention"]["kv_blocks_held"] > 0
    # kv_stats (the server reads the pool's geometry) and nothing the tests alone call.
    assert report["core_utilities"] == {
        "vllm_realtime_kv_stats": True,
        "vllm_realtime_retention_state": False,
        "vllm_realtime_scheduler_state": False,
        "vllm_realtime_heap_stats": False,
    }
    assert report["worker_utilities"] == dict.fromkeys(WORKER_UTILITIES, False)
    # The plugin acted in the worker: the model runner carries the retention hooks.
    marked = set(report["worker"]["marked"])
    assert {
        "GPUModelRunner._vllm_realtime_positions_patched",
        "GPUModelRunner._vllm_realtime_mrope_patched",
        "GPUModelRunner._vllm_realtime_preemption_patched",
        "EngineCore.vllm_realtime_kv_stats",
    } <= marked, marked
    assert not [m for m in marked if m.startswith("WorkerBase.")], marked
    assert "retention.vllm_adapter.diagnostics" not in report["worker"]["modules"]
    # The front end: the streaming hardening and the one-shot shutdown (start_engine).
    assert {"AsyncLLM._vllm_realtime_streaming_hardening", "AsyncLLM.shutdown"} <= set(
        report["front"]["marked"]
    )


@pytest.mark.slow
async def test_an_introspection_engine_has_the_test_utilities(smollm2_engine: Any) -> None:
    """tests/conftest.py's engines ask for introspection: the utilities the tests read."""
    from retention.vllm_adapter.diagnostics import heap_stats
    from retention.vllm_adapter.introspect import (
        kv_stats,
        retention_state,
        scheduler_state,
        worker_stats,
    )

    assert (await kv_stats(smollm2_engine))["block_size"] == 32
    assert await retention_state(smollm2_engine, "no-such-session") is None
    # A 1D model never binds an mRoPE position function.
    assert (await scheduler_state(smollm2_engine))["mrope_position_function"] is False
    (worker,) = await worker_stats(smollm2_engine)
    assert {"rss_bytes", "encoder_cache_entries", "mrope_columns_by_request"} <= set(worker)
    trimmed = await heap_stats(smollm2_engine, "trim_read")
    assert len(trimmed["workers"]) == 1 and trimmed["workers"][0]["rss_bytes"] > 0
