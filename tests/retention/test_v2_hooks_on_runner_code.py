"""Our V2 hooks executed over this vLLM's own V2 runner code under the Triton interpreter, no
model forward (tests/retention/v2_runner_code_harness.py, in a child process that has the
test-only Triton: tests/model_runner_mode.py). `make compat` runs it on 0.33's and 0.34's code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.model_runner_mode import ROOT, v2_env, v2_fixture_problem

pytestmark = [pytest.mark.compat, pytest.mark.slow]

SCENARIOS = (
    "positions_1d_after_eviction_and_slot_mappings",
    "fold_and_preempted_request_arrive_as_new",
    "mrope_rows_after_eviction_and_compaction",
    "mrope_reset_and_resume_keep_vllms_rows",
    "encoder_cache_entries_released",
)


@pytest.fixture(scope="module")
def harness_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    problem = v2_fixture_problem()
    if problem is not None:
        pytest.skip(problem)
    out = Path(tmp_path_factory.mktemp("v2-harness")) / "report.json"
    env = dict(os.environ)
    v2_env(env)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(ROOT)])
    env.setdefault("VLLM_TARGET_DEVICE", "cpu")
    done = subprocess.run(
        [sys.executable, "-m", "tests.retention.v2_runner_code_harness", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    if not report["triton"]:
        # 0.33/0.34's CUDA wheel, unpacked, is not a "cpu" vLLM to its triton_utils: it
        # disables Triton, so its V2 kernels cannot run here (docs/history/v2-runner.md).
        pytest.skip(f"vLLM {report['vllm']} disabled Triton in the harness process")
    return report


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_hooks_over_this_vllms_v2_runner_code(
    harness_report: dict[str, Any], scenario: str
) -> None:
    assert set(harness_report["results"]) == set(SCENARIOS)
    result = harness_report["results"][scenario]
    assert result == "ok", result
