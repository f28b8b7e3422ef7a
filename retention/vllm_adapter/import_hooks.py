"""Patch a vLLM module right after it is first imported (one shared import hook).

Processes that never load a module (the API front end never loads the model runner) never
import it because of us. Several patchers may target one module: they run in registration
order, each must be idempotent. One finder serves them all, so two hooks can never shadow each
other (a finder that resolves a spec itself bypasses any finder after it).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

Patcher = Callable[[ModuleType], None]

_PATCHERS: dict[str, list[Patcher]] = {}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patchers = _PATCHERS.get(fullname)
        if not patchers:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original_exec(module)
            for patcher in list(_PATCHERS.get(fullname, ())):
                patcher(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def patch_on_import(module_name: str, patcher: Patcher) -> None:
    """Run ``patcher(module)`` now if the module is loaded, else right after it loads.

    Idempotent per (module, patcher); the patcher itself must also be idempotent.
    """
    registered = _PATCHERS.setdefault(module_name, [])
    if patcher not in registered:
        registered.append(patcher)
    module = sys.modules.get(module_name)
    if module is not None:
        patcher(module)
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def patch_targets() -> list[str]:
    """The modules a patcher is registered for (tests read which hooks a process carries)."""
    return [name for name, patchers in _PATCHERS.items() if patchers]
