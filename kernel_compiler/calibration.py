"""Calibration tables: per-kernel times measured on a real GPU, stored beside the plan they time.

Layout: ``<plan dir>/calibration/<preset>.json``, one table per cost-model preset (the GPU kind it was
measured on, e.g. ``h100-80gb``). Where a table exists, `KernelPlan.kernel_seconds(preset)` returns
its measured seconds instead of the cost model's. A table is written atomically (temporary file, then
rename) and checked on read against the plan's kernels: a table for another lowering of the model
is an error that names the file, not a silent mismatch.
"""

from __future__ import annotations

import json
import math
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .plan import KernelPlan

CALIBRATION_DIR = "calibration"
TABLE_SCHEMA_VERSION = 1


class CalibrationError(ValueError):
    """A calibration table that cannot be used for its plan; the message names file and field."""


@dataclass
class CalibrationTable:
    """Measured seconds of every kernel of one plan (0.0 for view kernels) on one device."""

    preset: str
    device: str  # the device's own name, e.g. "NVIDIA H100 80GB HBM3"
    backend: str  # "cuda", or "emulated" for a table measured on the host (tests)
    model: str
    batch: int
    input_shape: list[int]
    kernels: list[str]
    seconds: list[float]
    method: str = ""
    schema_version: int = TABLE_SCHEMA_VERSION

    @property
    def total_seconds(self) -> float:
        return sum(self.seconds)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str, where: str) -> CalibrationTable:
        try:
            raw: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CalibrationError(f"{where}: not JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise CalibrationError(f"{where}: expected a JSON object, got {type(raw).__name__}")
        if raw.get("schema_version") != TABLE_SCHEMA_VERSION:
            raise CalibrationError(
                f"{where}: field schema_version is {raw.get('schema_version')!r}; "
                f"only {TABLE_SCHEMA_VERSION} is read (measure again with `make gpu-check`)"
            )
        fields = set(cls.__dataclass_fields__)
        missing = sorted(fields - set(raw) - {"method"})
        if missing:
            raise CalibrationError(f"{where}: missing fields {missing}")
        unknown = sorted(set(raw) - fields)
        if unknown:
            raise CalibrationError(f"{where}: unknown fields {unknown}; allowed: {sorted(fields)}")
        table = cls(**raw)
        bad = [i for i, s in enumerate(table.seconds) if not _is_duration(s)]
        if bad:
            raise CalibrationError(
                f"{where}: field seconds[{bad[0]}] is {table.seconds[bad[0]]!r}; "
                "allowed: a finite number >= 0"
            )
        if len(table.seconds) != len(table.kernels):
            raise CalibrationError(
                f"{where}: {len(table.seconds)} seconds for {len(table.kernels)} kernels"
            )
        return table

    def check_matches(self, plan: KernelPlan, where: str) -> None:
        """Raise unless this table times exactly `plan`'s kernels, in order."""
        names = [k.name for k in plan.kernels]
        if self.kernels != names:
            diff = next(
                (i for i, (a, b) in enumerate(zip(self.kernels, names, strict=False)) if a != b),
                min(len(self.kernels), len(names)),
            )
            raise CalibrationError(
                f"{where}: field kernels does not match the plan of {plan.model} (b{plan.batch}): "
                f"{len(self.kernels)} kernels against {len(names)}, first difference at index {diff}; "
                "the plan was lowered again since: measure again with `make gpu-check`"
            )


def _is_duration(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return math.isfinite(value) and value >= 0


def calibration_path(plan_dir: Path | str, preset: str) -> Path:
    return Path(plan_dir) / CALIBRATION_DIR / f"{preset}.json"


def write_calibration(plan_dir: Path | str, table: CalibrationTable) -> Path:
    """Store `table` beside the plan in `plan_dir` (atomically; replaces an older table)."""
    path = calibration_path(plan_dir, table.preset)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_text(table.to_json())
    os.replace(tmp, path)
    return path


def read_calibration(plan: KernelPlan, preset: str) -> CalibrationTable | None:
    """The table measured for `plan` on `preset`, if its directory holds one (checked against it)."""
    if plan._dir is None:
        return None
    path = calibration_path(plan._dir, preset)
    if not path.exists():
        return None
    table = CalibrationTable.from_json(path.read_text(), str(path))
    table.check_matches(plan, str(path))
    return table
