"""vLLM general plugin: runs once in every vLLM process (front end, EngineCore, workers).

Must be idempotent. It checks the vLLM version first, so that a mismatched install fails loudly in
every process before any hook patches internals it does not know; then installs the hooks.
"""

from __future__ import annotations

from retention.vllm_adapter import check_vllm_version

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    check_vllm_version()
    from retention.vllm_adapter.introspect import install_engine_core_utilities

    install_engine_core_utilities()
    _registered = True
