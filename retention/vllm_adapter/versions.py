"""The vLLM releases the adapter supports, serves on and recommends: plain data, read by the
package (`__init__.py`, which re-exports them) and by `capabilities.py` alike."""

from __future__ import annotations

from typing import Final

SUPPORTED_VLLM_VERSIONS: Final = ("0.32.0", "0.33.0", "0.34.0")
"""Each is tested: 0.32.0 by `make test`, 0.33.0 and 0.34.0 by `make compat`."""

WORKER_HOOKS_EXECUTED_ON: Final = ("0.32.0",)
"""Where tests execute the worker hooks (the model-runner patches): bounded sessions are served
only there. 0.33.0 keeps the V1 runner but has no CPU build to run them; 0.34.0 removed it."""

SERVING_VLLM_VERSION: Final = "0.32.0"
"""What scripts/setup.sh installs, and what error messages recommend."""
