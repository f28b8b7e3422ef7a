"""Start-up warnings about choices `serve` made on purpose, dropped by their exact text.

Each entry names the logger, the message's format string exactly as vLLM 0.32 passes it, the
arguments it must carry (None: any) and why dropping it hides nothing the operator can act on.
Any other message of those loggers still reaches the log. `install_quiet_start` is called in
every process of our engines (front end: plugin.install_front_end_hooks; EngineCore and worker:
the plugin); warnings raised through Python's `warnings` module in the spawned processes before
any plugin runs are dropped by the PYTHONWARNINGS entries of `quiet_start_warning_filters`,
which those processes inherit.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class DeliberateWarning:
    logger: str
    msg: str
    args: tuple[str, ...] | None
    why: str
    raised_in: str | None = None
    """Dropped only when a frame of the logging call's stack runs the vLLM function of this name
    (None: wherever it is raised)."""


SCHEDULER_CLASS = "retention.vllm_adapter.session_scheduler.RealtimeSessionScheduler"

DELIBERATE_WARNINGS: tuple[DeliberateWarning, ...] = (
    DeliberateWarning(
        "vllm.config.vllm",
        "Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup. "
        "This is equivalent to setting -cc.mode=none -cc.cudagraph_mode=none and "
        "--kernel_config.enable_jit_warmup=False",
        None,
        "serve runs the CPU engine eager on purpose and says so at start-up",
    ),
    DeliberateWarning(
        "vllm.config.vllm",
        "Inductor compilation was disabled by user settings, optimizations settings that are "
        "only active during inductor compilation will be ignored.",
        None,
        "follows from eager mode, which serve chose",
    ),
    DeliberateWarning(
        "vllm.platforms.cpu",
        "Triton is not installed. triton-cpu is expected on x86 CPUs.",
        None,
        "no Triton for CPU on PyPI; the CPU engine runs its torch fallbacks",
    ),
    DeliberateWarning(
        "vllm.config.scheduler",
        "Using custom scheduler class %s. This scheduler interface is not public and "
        "compatibility may not be maintained. If you have subclassed Scheduler instead of "
        "AsyncScheduler, you will see degraded performance due to async scheduling being "
        "disabled.",
        (SCHEDULER_CLASS,),
        "our scheduler, pinned to the vLLM versions retention/vllm_adapter checks",
    ),
    DeliberateWarning(
        "vllm.v1.worker.cpu_worker",
        "%s is not found in LD_PRELOAD. For best performance, please follow the section "
        "`set LD_PRELOAD` in https://docs.vllm.ai/en/latest/getting_started/installation/cpu/ "
        "to setup required pre-loaded libraries.",
        ("libtcmalloc",),
        "glibc malloc with one arena, measured against tcmalloc (benchmarks-2026.md)",
    ),
    DeliberateWarning(
        "vllm.v1.worker.cpu_worker",
        "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, "
        "skip it.",
        None,
        "serve binds no threads (nobind); OMP_NUM_THREADS sizes the worker",
    ),
    DeliberateWarning(
        "vllm.v1.engine.input_processor",
        "Passing raw prompts to InputProcessor is deprecated and will be removed in the future. "
        "You should instead pass the outputs of Renderer.render_cmpl() or Renderer.render_chat().",
        None,
        "raised by vLLM's own validation request of every streaming session (a raw "
        "TokensPrompt([0])); our chunks are rendered first (rendering.py)",
        raised_in="_add_streaming_input_request",
    ),
)

# Python-warning filters (PYTHONWARNINGS syntax: action:message-prefix:category), each why.
DELIBERATE_PYTHON_WARNINGS: tuple[tuple[str, str], ...] = (
    (
        "ignore:`torch.distributed.reduce_op` is deprecated:FutureWarning",
        "vLLM's torch fallbacks for Triton kernels scan every module, this deprecated alias too",
    ),
)


class DeliberateChoiceFilter(logging.Filter):
    """Drops the WARNING records of `entries` (exact format string and arguments)."""

    def __init__(self, entries: tuple[DeliberateWarning, ...]) -> None:
        super().__init__()
        self.entries = entries
        self.dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.WARNING:
            return True
        args = tuple(_arg_text(a) for a in record.args) if isinstance(record.args, tuple) else ()
        for entry in self.entries:
            if record.msg != entry.msg or (entry.args is not None and args != entry.args):
                continue
            if entry.raised_in is not None and not _on_stack(entry.raised_in):
                continue
            self.dropped += 1
            return False
        return True


def _on_stack(function: str) -> bool:
    """Whether a frame of the current call stack runs a function named `function`."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _arg_text(arg: object) -> str:
    """A class by its dotted name (vLLM passes the scheduler as a string or a class)."""
    return f"{arg.__module__}.{arg.__qualname__}" if isinstance(arg, type) else str(arg)


_installed: dict[str, DeliberateChoiceFilter] = {}


def install_quiet_start() -> dict[str, DeliberateChoiceFilter]:
    """Idempotent: one filter on each logger named in DELIBERATE_WARNINGS, in this process."""
    if not _installed:
        for name in sorted({entry.logger for entry in DELIBERATE_WARNINGS}):
            entries = tuple(e for e in DELIBERATE_WARNINGS if e.logger == name)
            _installed[name] = DeliberateChoiceFilter(entries)
            logging.getLogger(name).addFilter(_installed[name])
    return _installed


def quiet_start_warning_filters(existing: str) -> str:
    """PYTHONWARNINGS with our entries first: Python lets a later entry win, so the
    operator's own (`existing`) still decide."""
    ours = [spec for spec, _why in DELIBERATE_PYTHON_WARNINGS if spec not in existing]
    return ",".join(part for part in (*ours, existing) if part)
