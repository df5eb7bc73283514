"""Offline preparation: model zoo, kernel plans (lowering + serialisation), the on-disk model pool and
the profiler's memory analysis.

Modules: ``zoo`` (models), ``lowering`` (torch.export -> plan), ``plan`` (records, save/load),
``argcodec`` (JSON arguments), ``ops`` (run one kernel), ``model_pool`` (plans on disk),
``memory_profile`` (lazy/eager live bytes per kernel), ``registry`` (user models registered in the pool
by name and version: docs/models.md), ``model_import`` (a user's model into a checked plan),
``reference`` (the simplest plan executor, to check plans).
"""

from .lowering import LoweringError, lower_model, lower_module, reusing_built_models
from .memory_profile import KernelMemory, MemoryProfile, profile_plan
from .model_pool import ModelPool, PoolEntry
from .ops import invoke_kernel
from .plan import Kernel, KernelPlan, VarSpec
from .zoo import ZOO, ModelEntry, UnknownModelError, build_model, example_input

__all__ = [
    "ZOO",
    "Kernel",
    "KernelMemory",
    "KernelPlan",
    "LoweringError",
    "MemoryProfile",
    "ModelEntry",
    "ModelPool",
    "PoolEntry",
    "UnknownModelError",
    "VarSpec",
    "build_model",
    "example_input",
    "invoke_kernel",
    "lower_model",
    "lower_module",
    "profile_plan",
    "reusing_built_models",
]
