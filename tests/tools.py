"""External tools a test needs (hadolint, nginx, ffmpeg, node, chromium): skip where one is
missing on a developer's machine, fail in CI.

CI is told apart by the environment: `CI` set (what hosted runners set; `.ci/run` sets it too),
so a CI image that lost a tool turns red instead of skipping silently.
"""

from __future__ import annotations

import os
import shutil

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


def need(ok: bool, what: str) -> None:
    """Skip when a tool is missing, saying how to get it; in CI (.ci/run installs them) fail."""
    if ok:
        return
    if in_ci():
        pytest.fail(f"{what} (CI installs it in .ci/run)")
    pytest.skip(what)


def need_tool(name: str, install: str) -> str:
    """The path of an executable, or skip (fail in CI) saying how to install it."""
    path = shutil.which(name)
    need(path is not None, f"{name} is not installed: {install}")
    assert path is not None
    return path
