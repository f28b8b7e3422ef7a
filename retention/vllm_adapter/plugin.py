"""vLLM general plugin: runs once in every vLLM process (front end, EngineCore, workers).

Must be idempotent. It only checks the vLLM version for now, so that a mismatched install fails
loudly in every process, before any hook would patch internals it does not know.
"""

from __future__ import annotations

from retention.vllm_adapter import check_vllm_version

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    check_vllm_version()
    _registered = True
