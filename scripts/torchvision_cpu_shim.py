"""Make PyPI's torchvision importable beside a CPU-only torch (installed by scripts/setup.sh).

Why: the x86_64 torchvision wheel on PyPI is linked against CUDA libraries. Beside torch+cpu its
C++ extension (`torchvision/_C.so`) fails to load, and `import torchvision` then dies with
"operator torchvision::nms does not exist" while registering fake kernels for ops that were never
defined. transformers' Qwen-VL image/video processors only need torchvision's pure-Python
transforms, so defining the two op *schemas* that the import touches is enough; the C++ kernels
stay unavailable and nothing on our path calls them.

How: this module is imported from a `.pth` file at interpreter start (so spawned vLLM engine and
worker processes get it too). It only installs a meta-path hook; torch is not imported until
something imports torchvision. The hook first tries the real extension; only if that fails to
load does it define the schemas. On a CUDA machine the real extension loads and nothing changes.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_LIBRARY_HANDLE: list[object] = []  # keeps the torch.library.Library alive for the process


def _prepare_ops(package_dir: str) -> None:
    import glob
    import os

    import torch

    for path in glob.glob(os.path.join(package_dir, "_C*.so")):
        try:
            torch.ops.load_library(path)
            return  # the real extension works here: nothing to do
        except OSError:
            pass
    lib = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS:
        lib.define(schema)
    _LIBRARY_HANDLE.append(lib)


class _TorchvisionHook(importlib.abc.MetaPathFinder):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)  # one shot; also avoids recursion below
        spec = importlib.util.find_spec("torchvision")
        if spec is not None and spec.submodule_search_locations:
            # Never break interpreter start-up or the import itself.
            with contextlib.suppress(Exception):
                _prepare_ops(next(iter(spec.submodule_search_locations)))
        return spec


if not any(isinstance(f, _TorchvisionHook) for f in sys.meta_path):
    sys.meta_path.insert(0, _TorchvisionHook())
