"""Which vLLM model runner this pytest process's engines use: V1 (default) or V2.

vLLM decides whether Triton is usable once per process, when it is first imported
(`vllm/triton_utils/importing.py`), and the V2 runner needs it. So the runner is chosen per
pytest invocation, not per test: `REALTIME_TEST_RUNNER=v2` (`make test-v2`) runs the tests marked
`v2` on the V2 runner and skips the rest; unset, everything runs on V1 exactly as before.

The V2 runner executes on this CPU-only machine only with PyPI's Triton (scripts/setup.sh
installs it into `.v2-triton/`, outside the venv, whose CPU vLLM would otherwise find it), a
stand-in `cpu` backend entry (tests/v2_runner_site/sitecustomize.py) and `TRITON_INTERPRET=1`:
every Triton kernel runs in the interpreter. The engine's EngineCore and worker processes are
spawned and inherit this environment, `PYTHONPATH` included, so the stand-in is in each.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import Final

ROOT: Final = Path(__file__).resolve().parent.parent
TRITON_DIR: Final = ROOT / ".v2-triton"
SITE_DIR: Final = ROOT / "tests" / "v2_runner_site"
RUNNER_ENV: Final = "REALTIME_TEST_RUNNER"
RUNNER: Final = os.environ.get(RUNNER_ENV, "v1").strip().lower() or "v1"


def v2_fixture_problem() -> str | None:
    """Why the V2 fixture cannot run here (None: it can)."""
    if not (TRITON_DIR / "triton" / "__init__.py").is_file():
        return f"no Triton in {TRITON_DIR.name}/ (scripts/setup.sh installs it: make setup)"
    return None


def v2_env(env: MutableMapping[str, str]) -> None:
    """Set what every process of a V2 engine needs into `env` (os.environ, or a child's)."""
    paths = [str(TRITON_DIR), str(SITE_DIR)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["TRITON_INTERPRET"] = "1"
    env["REALTIME_TRITON_STAND_IN"] = "1"
    env["VLLM_USE_V2_MODEL_RUNNER"] = "1"


def enter_v2_mode() -> None:
    """This process and its children on the V2 runner; before anything imports vLLM."""
    problem = v2_fixture_problem()
    if problem is not None:
        raise RuntimeError(f"{RUNNER_ENV}=v2: {problem}")
    if "vllm" in sys.modules:
        raise RuntimeError(f"{RUNNER_ENV}=v2 must be entered before vLLM is imported")
    v2_env(os.environ)
    sys.path[:0] = [str(TRITON_DIR), str(SITE_DIR)]
    # The process started before the environment named the stand-in: install it now.
    spec = importlib.util.spec_from_file_location(
        "_realtime_triton_stand_in", SITE_DIR / "sitecustomize.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
