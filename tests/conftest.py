"""Shared fixtures: one real vLLM engine per default model for the whole test session.

Engines are started lazily (only tests that ask for them pay ~10-30 s) and shared, because the
CI machine has 2 cores. Every engine test is marked `slow`.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest

from tests.model_runner_mode import RUNNER, enter_v2_mode

if RUNNER == "v2":
    enter_v2_mode()

os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Small KV pools: enough for the tests, and free-block counts stay easy to reason about.
TEST_KV_BYTES = 48 << 20
TEST_BLOCK_SIZE = 32


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On the V2 runner (tests/model_runner_mode.py), only the tests marked `v2` run."""
    if RUNNER != "v2":
        return
    skip = pytest.mark.skip(reason="REALTIME_TEST_RUNNER=v2 runs the tests marked v2 only")
    for item in items:
        if item.get_closest_marker("v2") is None:
            item.add_marker(skip)


def engine_settings(model: str, **overrides: object):  # type: ignore[no-untyped-def]
    from realtime.engine import EngineSettings

    base = EngineSettings(
        model=model,
        max_model_len=1024,
        kv_cache_memory_bytes=TEST_KV_BYTES,
        block_size=TEST_BLOCK_SIZE,
        max_num_seqs=16,
        dtype="float32",
        # The tests read retention bookkeeping and worker state (retention_state, worker_stats),
        # which a `serve` engine does not carry (tests/retention/test_plugin_scope.py).
        introspection=True,
    )
    return base.with_overrides(**overrides)


@pytest.fixture(scope="session")
async def smollm2_engine() -> AsyncIterator[object]:
    from realtime.engine import start_engine

    engine = start_engine(engine_settings("smollm2-135m-instruct"))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
async def vlm_engine() -> AsyncIterator[object]:
    from realtime.engine import start_engine

    engine = start_engine(
        engine_settings("tiny-qwen2-vl", extra={"limit_mm_per_prompt": {"image": 1, "video": 1}})
    )
    yield engine
    engine.shutdown()
