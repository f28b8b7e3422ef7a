"""Python source parsed for the tests that read code (layout, layering, vLLM's own source)."""

from __future__ import annotations

import ast
import gc
from pathlib import Path


def parse(path: Path) -> ast.Module:
    """`path`'s module tree, parsed with the garbage collector off.

    CPython 3.11 keeps the AST conversion's recursion depth in interpreter-wide state, reset by
    each parse. A collection during the conversion can run Python code (a finalizer, or another
    thread once it has the GIL) that parses too, and this parse then fails with "SystemError: AST
    constructor recursion depth mismatch" (seen in CI; cpython gh-106905 is the same family).
    With the collector off nothing else runs until the conversion ends.
    """
    source = path.read_text()
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source, str(path))
    finally:
        if enabled:
            gc.enable()
