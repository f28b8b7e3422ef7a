"""`vllm-realtime selfcheck` as a user runs it: a subprocess, on V1 and on V2 (the test-only
Triton fixture of tests/model_runner_mode.py); every check passes and the exit status is 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.model_runner_mode import ROOT, v2_env, v2_fixture_problem

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_selfcheck_passes_on_this_machine(runner: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "clients/python")])}
    env.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    if runner == "v2":
        problem = v2_fixture_problem()
        if problem is not None:
            pytest.skip(problem)
        v2_env(env)
    done = subprocess.run(
        [sys.executable, "-m", "realtime.cli", "selfcheck", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(lines[-1])
    assert report["passed"]
    assert report["model_runner"].startswith(runner.upper()), report["model_runner"]
    names = [c["name"] for c in report["checks"]]
    assert names == [
        "engine",
        "eviction",
        "consolidation (re-prefill)",
        "consolidation (rotation)",
        "preemption",
        "blocks returned",
    ]
    assert all(
        c["status"] == "PASS" for c in report["checks"] if c["name"] != "consolidation (rotation)"
    )
    assert any(line.startswith("PASS selfcheck:") for line in lines)
