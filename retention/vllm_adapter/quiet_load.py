"""One line for a model stored in float32 and served in a narrower dtype, not one per weight.

vLLM 0.32's `AutoWeightsLoader` (vllm/model_executor/models/utils.py) warns "Attempted to load
weight X with dtype torch.float32 into parameter with dtype torch.bfloat16" for every weight it
narrows: 177 lines for the default model on a CPU with native bf16, none of which the user can
act on. vLLM's front end has already said it once ("Downcasting torch.float32 to
torch.bfloat16"), and `serve` says why that dtype ("dtype: ..." at start-up). A filter on that
logger in the worker drops exactly those narrowings (float32 into float16 or bfloat16) and
counts them; any other mismatch still warns.
"""

from __future__ import annotations

import logging

LOADER_LOGGER = "vllm.model_executor.models.utils"
_NARROWING = ("torch.float32",)
_NARROW_TARGETS = ("torch.bfloat16", "torch.float16")


class FloatNarrowingFilter(logging.Filter):
    """Drops the per-weight float32 → bf16/fp16 warning; counts what it dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING or not str(record.msg).startswith(
            "Attempted to load weight"
        ):
            return True
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) == 3 and str(args[1]) in _NARROWING and str(args[2]) in _NARROW_TARGETS:
            self.dropped += 1
            return False
        return True


_installed: FloatNarrowingFilter | None = None


def install_quiet_weight_loading() -> FloatNarrowingFilter:
    """Idempotent: the filter on vLLM's loader logger in this process."""
    global _installed
    if _installed is None:
        _installed = FloatNarrowingFilter()
        logging.getLogger(LOADER_LOGGER).addFilter(_installed)
    return _installed
