"""The CPU engine's process environment (realtime.engine.prepare_process_env): a core left to the
front end, one malloc arena."""

from __future__ import annotations

import os

import pytest

from realtime import engine


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.setattr(engine, "_has_cuda", lambda: False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    return monkeypatch


def test_worker_gets_one_core_fewer_than_usable(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setattr(os, "sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    engine.prepare_process_env()
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert os.environ["OMP_NUM_THREADS"] == "3"


def test_one_core_keeps_one_thread(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setattr(os, "sched_getaffinity", lambda _pid: {0})
    engine.prepare_process_env()
    assert os.environ["OMP_NUM_THREADS"] == "1"


@pytest.mark.parametrize(("name", "value"), [("OMP_NUM_THREADS", "2"), ("MALLOC_ARENA_MAX", "4")])
def test_operator_settings_are_kept(clean_env: pytest.MonkeyPatch, name: str, value: str) -> None:
    clean_env.setenv(name, value)
    engine.prepare_process_env()
    assert os.environ[name] == value


def test_vllm_binding_owns_threads(clean_env: pytest.MonkeyPatch) -> None:
    # With a binding, vLLM sizes the worker's threads itself.
    clean_env.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    engine.prepare_process_env()
    assert "OMP_NUM_THREADS" not in os.environ


def test_engine_processes_get_one_malloc_arena(clean_env: pytest.MonkeyPatch) -> None:
    engine.prepare_process_env()
    assert os.environ["MALLOC_ARENA_MAX"] == "1"
