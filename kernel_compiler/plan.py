"""Kernel plans: a model lowered into a flat, serialisable list of destination-passing kernels.

A plan is specialised for one (model, batch, input shape). Its variables are the buffers of one
inference: the input, the weights, the intermediates and outputs each kernel writes into, and views,
which alias another variable and allocate nothing. The executor (``api_proxy``) owns allocation: it
allocates each storage variable from the pool, calls ``ops.invoke_kernel`` per kernel, and recycles an
intermediate once the kernels that touched it reach ``expected_accesses``.

Every kernel carries its cost (``cost_model``: op class, FLOPs, bytes read and written), filled in
at lowering; ``kernel_seconds(preset)`` turns the costs into per-kernel seconds on a GPU preset, or
returns the seconds measured on that GPU where a calibration table lies beside the plan.

On disk (``KernelPlan.save``): ``plan.json`` (everything but the weights) and ``weights.safetensors``
(the weight variables by name, contiguous). Schema 1 plans (saved before kernels had costs) still
load: their costs are recomputed from the plan's own variables on load.
"""

from __future__ import annotations

import filecmp
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import cost_model
from .argcodec import dtype_from_name
from .calibration import read_calibration

#: 3: eval batch norm's save_mean/save_invstd sized for CUDA's kernel (`ops.DEVICE_SIZED_OUTPUTS`);
#: 2: kernel costs. An older plan is stale: the model pool lowers it again.
SCHEMA_VERSION = 3
PLAN_FILE = "plan.json"
WEIGHTS_FILE = "weights.safetensors"

class StalePlan(ValueError):
    """A plan saved under an older schema: lower the model again (`ModelPool.get_or_lower` does)."""


VAR_KINDS = ("input", "weight", "intermediate", "output", "view")
STORAGE_KINDS = ("input", "weight", "intermediate", "output")


@dataclass
class VarSpec:
    """One variable of a plan.

    Storage variables (every kind but ``view``) own ``nbytes`` of memory laid out by ``shape`` and
    ``strides`` from offset 0. A view aliases the storage variable ``base`` (always a storage variable,
    never another view) at ``storage_offset``; its ``nbytes`` is 0 because it allocates nothing.
    ``expected_accesses`` is defined on storage variables: the number of kernels, view kernels
    included, that name the variable or a view of it among their arguments or outputs.
    """

    name: str
    kind: str
    dtype: str
    shape: list[int]
    strides: list[int]
    storage_offset: int
    nbytes: int
    base: str | None = None
    expected_accesses: int = 0

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def is_view(self) -> bool:
        return self.kind == "view"

    def empty(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """An uninitialised tensor with this storage variable's layout (for tests and simple executors)."""
        if self.is_view:
            raise ValueError(f"{self.name} is a view; run its view kernel on its base instead")
        return torch.empty_strided(self.shape, self.strides, dtype=self.torch_dtype, device=device)


@dataclass
class Kernel:
    """One kernel of a plan.

    ``kind`` is ``"compute"`` (writes into preallocated ``outputs``) or ``"view"`` (returns aliases of
    its arguments; re-executed at run time on the base tensor). ``op`` is the overload called: the
    ``.out`` overload for compute kernels (its out arguments are ``out_args``, paired with
    ``outputs``), the functional op for view kernels and for fallbacks (``fallback=True``: the op has no
    ``.out`` overload, so its result is copied into the outputs). ``args``/``kwargs`` are encoded by
    ``argcodec``. ``accesses`` are the storage variables this kernel touches, directly or through views;
    each counts one access of each. ``op_class``, ``flops``, ``bytes_read`` and ``bytes_written`` are
    its cost (``cost_model.kernel_cost``).
    """

    name: str
    op: str
    kind: str
    args: list[Any]
    kwargs: dict[str, Any]
    outputs: list[str]
    out_args: list[str] = field(default_factory=list)
    fallback: bool = False
    source_op: str = ""
    accesses: list[str] = field(default_factory=list)
    op_class: str = ""
    flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    # Filled in lazily by ops.invoke_kernel: the resolved overload and decoded arguments.
    _prepared: Any = field(default=None, init=False, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "op": self.op,
            "kind": self.kind,
            "args": self.args,
            "kwargs": self.kwargs,
            "outputs": self.outputs,
            "out_args": self.out_args,
            "fallback": self.fallback,
            "source_op": self.source_op,
            "accesses": self.accesses,
            "op_class": self.op_class,
            "flops": self.flops,
            "bytes_read": self.bytes_read,
            "bytes_written": self.bytes_written,
        }


@dataclass
class KernelPlan:
    """A model lowered for one batch size and input shape (``input_shape`` excludes the batch)."""

    model: str
    batch: int
    input_shape: list[int]
    input_dtype: str
    variables: dict[str, VarSpec]
    kernels: list[Kernel]
    inputs: list[str]
    outputs: list[str]
    meta: dict[str, Any] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    # Weights stay in memory after lowering; a loaded plan reads them from its directory on demand.
    _weights: dict[str, torch.Tensor] | None = field(default=None, repr=False, compare=False)
    _dir: Path | None = field(default=None, repr=False, compare=False)
    # kernel_seconds per preset, computed once per plan object (the executor asks on every run).
    _seconds: dict[str, list[float]] = field(default_factory=dict, repr=False, compare=False)

    # --- queries ---

    def vars_of_kind(self, kind: str) -> list[VarSpec]:
        return [v for v in self.variables.values() if v.kind == kind]

    def root(self, name: str) -> str:
        """The storage variable behind ``name`` (itself unless it is a view)."""
        var = self.variables[name]
        return var.base if var.base is not None else name

    @property
    def fallback_count(self) -> int:
        return sum(k.fallback for k in self.kernels)

    @property
    def weight_bytes(self) -> int:
        return sum(v.nbytes for v in self.vars_of_kind("weight"))

    @property
    def weight_names(self) -> list[str]:
        return [v.name for v in self.vars_of_kind("weight")]

    # --- costs ---

    def kernel_seconds(self, preset: str) -> list[float]:
        """Seconds of each kernel on the GPU preset `preset` (``v100-16gb``, ``h100-80gb``, ...): the
        times measured on that GPU where a calibration table for it lies beside the plan, else the
        cost model's. View kernels take 0. Computed once per plan object and preset."""
        seconds = self._seconds.get(preset)
        if seconds is None:
            cost_model.get_preset(preset)  # an unknown preset fails even where a table exists
            table = read_calibration(self, preset)
            if table is not None:
                seconds = list(table.seconds)
            else:
                seconds = cost_model.modelled_seconds(map(cost_model.cost_of, self.kernels), preset)
            self._seconds[preset] = seconds
        return list(seconds)

    @property
    def total_flops(self) -> int:
        return sum(k.flops for k in self.kernels)

    # --- weights ---

    def load_weights(self, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
        """Weight tensors (CPU) by variable name; all of them unless ``names`` is given."""
        wanted = list(self.weight_names if names is None else names)
        if self._weights is not None:
            return {n: self._weights[n] for n in wanted}
        if self._dir is None:
            raise RuntimeError(f"plan for {self.model} has neither in-memory weights nor a directory")
        with safe_open(self._dir / WEIGHTS_FILE, framework="pt", device="cpu") as f:
            return {n: f.get_tensor(n) for n in wanted}

    # --- serialisation ---

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "model": self.model,
            "batch": self.batch,
            "input_shape": list(self.input_shape),
            "input_dtype": self.input_dtype,
            "variables": [asdict(v) for v in self.variables.values()],
            "kernels": [k.to_dict() for k in self.kernels],
            "inputs": self.inputs,
            "outputs": self.outputs,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KernelPlan:
        version = d.get("schema_version")
        if version != SCHEMA_VERSION:
            kind = StalePlan if isinstance(version, int) and version < SCHEMA_VERSION else ValueError
            raise kind(f"plan schema version {version!r} is not {SCHEMA_VERSION}; lower again")
        plan = cls(
            model=d["model"],
            batch=d["batch"],
            input_shape=list(d["input_shape"]),
            input_dtype=d["input_dtype"],
            variables={v["name"]: VarSpec(**v) for v in d["variables"]},
            kernels=[Kernel(**k) for k in d["kernels"]],
            inputs=list(d["inputs"]),
            outputs=list(d["outputs"]),
            meta=dict(d.get("meta", {})),
        )
        return plan

    def save(self, directory: Path | str) -> Path:
        """Write ``plan.json`` and ``weights.safetensors`` into ``directory`` (created if missing)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        save_file(_unshared(self.load_weights()), str(directory / WEIGHTS_FILE))
        # allow_nan=False: every non-finite float must have gone through argcodec's tagging.
        (directory / PLAN_FILE).write_text(json.dumps(self.to_dict(), indent=1, allow_nan=False))
        return directory

    @classmethod
    def load(cls, directory: Path | str) -> KernelPlan:
        """Read a saved plan; weights are read from ``weights.safetensors`` when asked for."""
        directory = Path(directory)
        plan = cls.from_dict(json.loads((directory / PLAN_FILE).read_text()))
        plan._dir = directory
        return plan


def share_weights(fresh: Path, model_dir: Path) -> Path | None:
    """Make `fresh`'s weights file a hard link to an identical one of another plan directory under
    `model_dir`, if there is one; returns that file. A model's weights do not depend on the batch or
    the input shape, so without this every new (batch, shape) an `infer` meets stored a full copy on
    disk. Best effort: where hard links fail (a file system without them, a plan retired meanwhile)
    the copy stays."""
    mine = fresh / WEIGHTS_FILE
    size = mine.stat().st_size
    for other in sorted(model_dir.glob(f"*/{WEIGHTS_FILE}")):
        if other.parent == fresh or other.parent.name.startswith("."):
            continue
        try:
            if other.stat().st_size != size or other.stat().st_ino == mine.stat().st_ino:
                continue
            if not filecmp.cmp(mine, other, shallow=False):
                continue
            linked = fresh / f".{WEIGHTS_FILE}.link"
            os.link(other, linked)
            os.replace(linked, mine)  # one step: a reader sees one whole file or the other
        except OSError:
            continue
        return other
    return None


def _unshared(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors that share storage or do not span all of it; copy only those."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        t = t.detach()
        ptr = t.untyped_storage().data_ptr()
        whole = t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
        out[name] = t if whole and ptr not in seen else t.contiguous().clone()
        seen.add(ptr)
    return out
