"""Which model runner serves bounded sessions, decided by the capability record (no engine).

The record (retention/vllm_adapter/capabilities.py) says, per release and runner, whether
serving is allowed and what tests executed of the hooks there; serve's runner choice
(`realtime.engine.select_model_runner`), the scheduler's check and the README's table follow
it. Stand-in records give each release's shape on any installed vLLM; the tests that read a
release's own classes (the standalone CPU runner) run on each release's code under
`make compat`.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from realtime.engine import (
    V2_RUNNER_SWITCH,
    EngineConfigError,
    names_our_worker,
    select_model_runner,
)
from retention.vllm_adapter import V2_HOOKS_EXECUTED
from retention.vllm_adapter.capabilities import VLLMCapabilities, vllm_capabilities
from retention.vllm_adapter.v2 import (
    CPU_WORKER_CLS,
    runner_class_refusal,
    v2_retention_refusal,
)

pytestmark = pytest.mark.compat

ROOT = Path(__file__).resolve().parents[2]
V034_TEXT = "hooks tested on 0.34's runner code under the Triton interpreter; never run on a GPU"


def record(release: str) -> VLLMCapabilities:
    """The installed record reshaped as `release` (its runner modules, read from its wheel)."""
    return replace(
        vllm_capabilities(),
        version=release,
        v1_model_runner=release != "0.34.0",
        v2_model_runner=True,
    )


def test_the_record_serves_0_34_on_v2_only_and_0_33_on_v2_only() -> None:
    r32, r33, r34 = record("0.32.0"), record("0.33.0"), record("0.34.0")
    assert r32.serving_refusal("v1") is None and r32.serving_refusal("v2") is None
    assert r34.serving_refusal("v2") is None and r33.serving_refusal("v2") is None
    assert r34.hooks_executed("v2") == V034_TEXT
    assert r33.hooks_executed("v2") == V2_HOOKS_EXECUTED["0.33.0"]
    assert "runner code" not in str(r32.hooks_executed("v2"))  # 0.32: oracle tests ran on it
    refused = r34.serving_refusal("v1")
    assert refused is not None and "has no V1 GPU model runner" in refused
    refused = r33.serving_refusal("v1")
    assert refused is not None and "keeps the V1 GPU model runner" in refused
    assert "Its V2 runner serves" in refused
    # A release without the V2 runner module, or one whose runner code no test ran the hooks
    # on, is refused with the reason (a record, not a version string, decides).
    refused = replace(r34, v2_model_runner=False).serving_refusal("v2")
    assert refused is not None and "has no V2 model runner" in refused
    refused = replace(r34, version="0.35.0").serving_refusal("v2")
    assert refused is not None and "not executed by any test on vLLM 0.35.0" in refused


@pytest.mark.parametrize("cuda", [False, True])
def test_0_34_serves_on_v2_and_the_start_up_line_says_what_ran(cuda: bool) -> None:
    env: dict[str, str] = {}
    line = select_model_runner(env, record("0.34.0"), cuda)
    assert env == {}  # 0.34 raises on VLLM_USE_V2_MODEL_RUNNER=0: left alone
    assert line.startswith("model runner: V2 (vLLM 0.34.0's only model runner;")
    assert line.endswith(f"; {V034_TEXT})")
    with pytest.raises(EngineConfigError, match="has no V1 GPU model runner"):
        select_model_runner({V2_RUNNER_SWITCH: "0"}, record("0.34.0"), cuda)
    assert names_our_worker({}, cuda, v1_present=False)


def test_0_33_serves_on_the_v2_runner_vllm_picks_and_refuses_v1() -> None:
    env: dict[str, str] = {}
    line = select_model_runner(env, record("0.33.0"), cuda=True)
    assert env == {}
    assert line.startswith("model runner: V2 (vLLM's choice where Triton is present, kept")
    assert line.endswith(f"; {V2_HOOKS_EXECUTED['0.33.0']})")
    with pytest.raises(EngineConfigError, match="keeps the V1 GPU model runner"):
        select_model_runner({V2_RUNNER_SWITCH: "0"}, record("0.33.0"), cuda=True)


def test_0_32_keeps_v1_on_cpu_and_the_runner_vllm_picks_on_cuda() -> None:
    r32 = record("0.32.0")
    # CPU: V1, what the tests run, set before vLLM reads it; V2 on the operator's switch.
    env: dict[str, str] = {}
    line = select_model_runner(env, r32, cuda=False)
    assert env == {V2_RUNNER_SWITCH: "0"}
    assert line.startswith("model runner: V1 (VLLM_USE_V2_MODEL_RUNNER=0, set by serve on CPU")
    assert not names_our_worker(env, cuda=False, v1_present=True)
    env = {V2_RUNNER_SWITCH: "1"}
    line = select_model_runner(env, r32, cuda=False)
    assert line.startswith("model runner: V2 (VLLM_USE_V2_MODEL_RUNNER=1, set by the operator;")
    assert "Triton interpreter" in line and "never run on a GPU" in line
    assert names_our_worker(env, cuda=False, v1_present=True)
    # CUDA: serve no longer forces V1; our worker builds whichever runner vLLM takes.
    env = {}
    line = select_model_runner(env, r32, cuda=True)
    assert env == {} and line.startswith("model runner: V2 (vLLM's choice")
    assert names_our_worker(env, cuda=True, v1_present=True)
    env = {V2_RUNNER_SWITCH: "0"}
    assert select_model_runner(env, r32, cuda=True).startswith("model runner: V1 (")
    assert names_our_worker(env, cuda=True, v1_present=True)


def test_the_engine_runner_is_v2_where_vllm_has_no_v1_runner() -> None:
    # 0.34's VllmConfig has no `use_v2_model_runner`: the record answers without it.
    assert record("0.34.0").runner_of(SimpleNamespace()) == "v2"
    for choice, runner in ((True, "v2"), (False, "v1")):
        config = SimpleNamespace(use_v2_model_runner=choice)
        assert record("0.32.0").runner_of(config) == runner


class _FakeV2Base:
    """A class named as vLLM's V2 runner: runners are matched by name along their MRO."""


_FakeV2Base.__module__, _FakeV2Base.__qualname__ = (
    "vllm.v1.worker.gpu.model_runner",
    ("GPUModelRunner"),
)


def _config(worker_cls: str) -> Any:
    return SimpleNamespace(parallel_config=SimpleNamespace(worker_cls=worker_cls))


def test_a_runner_not_derived_from_the_v2_runner_refuses_bounded_sessions() -> None:
    class V2Based(_FakeV2Base):
        pass

    class Standalone:
        pass

    assert runner_class_refusal(V2Based) is None
    refusal = runner_class_refusal(Standalone)
    assert refusal is not None and "not derived from the V2 runner" in refusal
    assert v2_retention_refusal(_config(CPU_WORKER_CLS), runner_cls=V2Based) is None
    refusal = v2_retention_refusal(_config(CPU_WORKER_CLS), runner_cls=Standalone)
    assert refusal is not None and "Standalone" in refusal


STANDALONE = "vllm.v1.worker.cpu.standalone_model_runner"


def test_vllm_0_34_standalone_cpu_runner_is_refused_by_its_class(monkeypatch: Any) -> None:
    """On 0.34's code (`make compat`): its CPU worker's two runners, read by class."""
    if importlib.util.find_spec(STANDALONE) is None:
        assert vllm_capabilities().release != "0.34.0"
        pytest.skip(f"no {STANDALONE} in vLLM {vllm_capabilities().version}")
    from vllm.platforms import current_platform
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner
    from vllm.v1.worker.cpu.standalone_model_runner import StandaloneCPUModelRunner

    assert runner_class_refusal(CPUModelRunner) is None  # V2-based: our worker wraps it
    refusal = runner_class_refusal(StandaloneCPUModelRunner)
    assert refusal is not None and f"{STANDALONE}.StandaloneCPUModelRunner" in refusal
    # The scheduler finds it where the platform makes the CPU worker build it.
    assert v2_retention_refusal(_config(CPU_WORKER_CLS)) is None  # x86 here: the V2 one
    monkeypatch.setattr(
        type(current_platform), "uses_standalone_cpu_model_runner", classmethod(lambda c: True)
    )
    refusal = v2_retention_refusal(_config(CPU_WORKER_CLS))
    assert refusal is not None and "StandaloneCPUModelRunner" in refusal


def _readme_table() -> dict[str, list[str]]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Supported vLLM", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if re.fullmatch(r"\d+\.\d+\.\d+", cells[0]):
            rows[cells[0]] = cells[1:]
    return rows


def test_the_readme_table_says_what_the_record_decides() -> None:
    rows = _readme_table()
    assert set(rows) == set(V2_HOOKS_EXECUTED)
    for release, cells in rows.items():
        cuda_v1, cuda_v2 = cells[2], cells[3]
        for runner, cell in (("v1", cuda_v1), ("v2", cuda_v2)):
            refused = record(release).serving_refusal(runner) is not None
            assert refused == ("refused" in cell or "removed upstream" in cell), (release, cell)
    for release in ("0.33.0", "0.34.0"):
        assert V2_HOOKS_EXECUTED[release] in rows[release][3]
