"""Engine processes end with the server that started them.

Theory of operation: vLLM's EngineCore process (and, on the CPU build, its worker process) is a
`multiprocessing` child of the server. vLLM's worker already notices the EngineCore's death (a
pipe), but the EngineCore does not notice the server's: a server killed outright (SIGKILL, OOM
killer) left EngineCore and worker running, reparented to init, ~1.7 GB. So in every process
that `multiprocessing` spawned, the vLLM plugin asks the kernel for SIGKILL when the parent
dies (`prctl(PR_SET_PDEATHSIG)`): EngineCore dies with the server, the worker with EngineCore.
SIGKILL, not SIGTERM: vLLM's graceful path waits for the worker (3-5 s idle, over 10 s seen on
a loaded machine), and an engine whose server is gone has nothing to save. Shared memory they
leave is unlinked by multiprocessing's resource tracker once its last holder is gone.

The same processes ignore SIGINT: Ctrl-C in a terminal reaches the whole foreground process
group, and the engine must outlive the server's graceful drain; the server stops it (vLLM
terminates its EngineCore with SIGTERM) once the drain is over.

Linux only; elsewhere this does nothing. PR_SET_PDEATHSIG fires when the *thread* that spawned
the process exits; vLLM spawns EngineCore and workers from the thread that builds the engine,
which lives as long as the engine.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_installed = False


def _set_parent_death_signal(sig: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def install_parent_death_watch() -> bool:
    """In a process spawned by `multiprocessing`: SIGKILL on the parent's death, SIGINT ignored.

    Returns whether the watch is set. A top-level process (the server, a script, pytest) is left
    alone. Idempotent."""
    global _installed
    if _installed:
        return True
    parent = multiprocessing.parent_process()
    if parent is None or not sys.platform.startswith("linux"):
        return False
    if not _set_parent_death_signal(signal.SIGKILL):
        return False
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _installed = True
    # The parent may have died before the prctl: then nobody will ever signal us.
    if parent.pid is not None and os.getppid() != parent.pid:
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def install_idempotent_shutdown() -> None:
    """Make `AsyncLLM.shutdown` run once per engine (front end; idempotent).

    vLLM's `AsyncLLM.__del__` calls `shutdown()` again. After the server (or a test) has shut
    the engine down, that second call ran at interpreter teardown, with vLLM's module globals
    already cleared, and printed a TypeError traceback at the end of every run. The wrapper
    keeps what it needs in its closure (module globals may be None by then) and returns at
    once for an engine that is already shut down.
    """
    from vllm.v1.engine.async_llm import AsyncLLM

    if getattr(AsyncLLM.shutdown, "_vllm_realtime_once", False):
        return
    original = AsyncLLM.shutdown
    done_attr = "_vllm_realtime_shut_down"

    def shutdown(self: Any, *args: Any, **kwargs: Any) -> None:
        if self.__dict__.get(done_attr):
            return
        self.__dict__[done_attr] = True
        original(self, *args, **kwargs)

    shutdown.__doc__ = original.__doc__
    shutdown._vllm_realtime_once = True  # type: ignore[attr-defined]
    AsyncLLM.shutdown = shutdown
