"""Start-up warnings for serve's deliberate choices are dropped by their exact text, others stay.

The texts are checked against the installed vLLM's and torch's source and warnings, so a vLLM
that rewords one shows here rather than as a noisier start-up (bench.capacity --startup counts
the whole log).
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from retention.vllm_adapter.quiet_start import (
    DELIBERATE_WARNINGS,
    SCHEDULER_CLASS,
    install_quiet_start,
    quiet_start_warning_filters,
)
from tests.python_source import parse


def _vllm_source(module: str) -> ast.Module:
    """The installed vLLM module's source, parsed, unimported."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    path = Path(spec.origin).parent.joinpath(*module.split(".")[1:]).with_suffix(".py")
    return parse(path)


def _string_constants(module: str) -> set[str]:
    """Every string literal of `module`'s source (implicit concatenations joined)."""
    tree = _vllm_source(module)
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


@pytest.mark.parametrize("entry", DELIBERATE_WARNINGS, ids=lambda e: e.msg[:30])
def test_each_text_is_the_installed_vllms(entry) -> None:  # type: ignore[no-untyped-def]
    assert entry.msg in _string_constants(entry.logger), entry.logger
    assert entry.why


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _logged(logger: str, msg: str, *args: object) -> list[str]:
    kept = _Kept()
    log = logging.getLogger(logger)
    log.addHandler(kept)
    try:
        log.warning(msg, *args)
    finally:
        log.removeHandler(kept)
    return kept.lines


def test_deliberate_warnings_are_dropped_and_the_rest_kept() -> None:
    filters = install_quiet_start()
    assert install_quiet_start() is filters
    for entry in DELIBERATE_WARNINGS:
        args = entry.args if entry.args is not None else ()
        if entry.raised_in is None:
            assert _logged(entry.logger, entry.msg, *args) == [], entry.msg
    tcmalloc = next(e for e in DELIBERATE_WARNINGS if e.args == ("libtcmalloc",))
    # libiomp is not measured here: its line stays.
    assert len(_logged(tcmalloc.logger, tcmalloc.msg, "libiomp")) == 1
    scheduler = next(e for e in DELIBERATE_WARNINGS if e.args == (SCHEDULER_CLASS,))
    assert len(_logged(scheduler.logger, scheduler.msg, "my.OtherScheduler")) == 1
    # vLLM may pass the class itself.
    session_scheduler = type("RealtimeSessionScheduler", (), {})
    session_scheduler.__module__ = SCHEDULER_CLASS.rsplit(".", 1)[0]
    assert _logged(scheduler.logger, scheduler.msg, session_scheduler) == []
    # A nearby message of the same logger still warns.
    assert len(_logged("vllm.platforms.cpu", "Triton is not installed.")) == 1
    assert len(_logged("vllm.config.vllm", DELIBERATE_WARNINGS[0].msg + " (changed)")) == 1


def test_a_warning_of_vllms_own_call_is_dropped_only_when_that_call_raises_it() -> None:
    install_quiet_start()
    (entry,) = (e for e in DELIBERATE_WARNINGS if e.raised_in is not None)
    assert entry.raised_in == "_add_streaming_input_request"

    def _add_streaming_input_request() -> list[str]:
        return _logged(entry.logger, entry.msg)

    assert _add_streaming_input_request() == []
    # Raised by any other caller (ours rendering nothing, say) it stays in the log.
    assert _logged(entry.logger, entry.msg) == [entry.msg]
    # vLLM's own validation request is where it is raised, by that name.
    assert entry.raised_in in _function_names("vllm.v1.engine.async_llm")


def _function_names(module: str) -> set[str]:
    tree = _vllm_source(module)
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def _stderr_of(code: str, pythonwarnings: str) -> str:
    env = dict(os.environ, PYTHONWARNINGS=pythonwarnings)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return out.stderr


def test_torch_reduce_op_deprecation_is_dropped_in_processes_that_inherit_the_env() -> None:
    touch = "import torch.distributed as d; d.reduce_op.SUM"
    assert "reduce_op` is deprecated" in _stderr_of(touch, "")
    assert _stderr_of(touch, quiet_start_warning_filters("")) == ""
    other = "import warnings; warnings.warn('something else is deprecated', FutureWarning)"
    assert "something else" in _stderr_of(other, quiet_start_warning_filters(""))
    # The operator's own entries come last, so they decide.
    assert quiet_start_warning_filters("error").endswith(",error")
    assert "reduce_op" in _stderr_of(touch, quiet_start_warning_filters("always::FutureWarning"))


def test_serve_takes_uvicorns_websocket_implementation_that_warns_nothing() -> None:
    from realtime.server import WS_IMPLEMENTATION

    assert WS_IMPLEMENTATION == "websockets-sansio"
    load = (
        "from uvicorn.config import WS_PROTOCOLS; from uvicorn.importer import import_from_string; "
        f"import_from_string(WS_PROTOCOLS[{WS_IMPLEMENTATION!r}])"
    )
    assert _stderr_of(load, "") == ""
    # The legacy one, which serve left, still warns: the check above can tell them apart.
    legacy = "import uvicorn.protocols.websockets.websockets_impl"
    assert "`websockets` implementation is deprecated" in _stderr_of(legacy, "")
