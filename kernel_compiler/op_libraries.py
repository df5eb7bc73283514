"""Operator libraries: packages whose ops exist in `torch.ops` only once the package is imported.

torchvision registers `torch.ops.torchvision.*` (nms, roi_align, deform_conv2d: a plan's fallback
kernels, names in a saved `.pt2` program) when it is imported, and importing it costs seconds of CPU
(it imports torch._dynamo). So a process imports it where it needs it: to build a zoo model, to resolve
one of its ops, to load a saved program. Under `TORCH_MODE_LOCK`: a lowering thread's `torch.export`
imports torch._dynamo lazily too, and two threads importing one circle of modules at once can see one
of them half made.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .cost_model import TORCH_MODE_LOCK

OP_LIBRARIES = ("torchvision",)


def import_library(module: str) -> ModuleType:
    """`module` (an operator library or a module of one), imported under `TORCH_MODE_LOCK`."""
    with TORCH_MODE_LOCK:
        return importlib.import_module(module)


def import_op_libraries(namespace: str | None = None) -> None:
    """Import the library of op namespace `namespace` if it is one (None: every library)."""
    for library in OP_LIBRARIES:
        if namespace is None or namespace == library:
            import_library(library)
