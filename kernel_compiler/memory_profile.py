"""The profiler's memory analysis of a kernel plan (pure: no device, no threads, no clock).

Two allocation regimes for the plan's intermediates and outputs:

- *eager* (paper's FM: lazy allocation + eager recycling): a storage variable is allocated right before
  the first kernel that touches it (its producer) and freed right after the kernel whose access makes
  its count reach ``expected_accesses``; outputs stay until the end (the caller takes them);
- *no eager*: every intermediate and output is allocated before the first kernel and freed after the
  last, so the live bytes are the same at every kernel.

Weights and inputs are reported separately: weights are cached in the pool across requests, inputs
belong to the caller. ``weight_resident`` is what weights would occupy if loaded at first use (the
pipelined loading of the IO daemon). Views never count: they allocate nothing.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from .plan import KernelPlan


@dataclass
class KernelMemory:
    """Memory seen while kernel ``index`` runs (bytes)."""

    index: int
    name: str
    op: str
    kind: str
    output_bytes: int  # storage this kernel's outputs allocate (0 for view kernels)
    live_eager: int  # intermediates + outputs live during the kernel, lazy + eager
    live_no_eager: int  # the same, allocated up front and freed at the end
    weight_resident: int  # weights touched so far (loaded at first use, cached afterwards)
    allocated: list[str] = field(default_factory=list)  # allocated right before this kernel
    freed: list[str] = field(default_factory=list)  # freed right after it (eager)


@dataclass
class MemoryProfile:
    """Per-kernel memory of one plan, plus the model's peaks.

    ``runtime_s`` is one entry per kernel (aligned with ``kernels``), filled in later from a device
    backend's timings; None until then. ``runtime_source`` says whose times they are: a cost-model
    preset name (``v100-16gb``) or ``measured:<device name>``; None for times stored before it existed.
    """

    model: str
    batch: int
    input_shape: list[int]
    weight_bytes: int
    input_bytes: int
    output_bytes: int
    peak_eager: int
    peak_no_eager: int
    kernels: list[KernelMemory]
    runtime_s: list[float] | None = None
    runtime_source: str | None = None

    def demand(self, eager: bool = True, weights: bool = True, inputs: bool = True) -> list[int]:
        """The demand time series, one point per kernel: live intermediates/outputs under the chosen
        regime, plus (all) weights and the inputs if asked for."""
        extra = (self.weight_bytes if weights else 0) + (self.input_bytes if inputs else 0)
        return [(k.live_eager if eager else k.live_no_eager) + extra for k in self.kernels]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MemoryProfile:
        d = dict(d)
        d["kernels"] = [KernelMemory(**k) for k in d["kernels"]]
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> MemoryProfile:
        return cls.from_dict(json.loads(text))


def profile_plan(plan: KernelPlan) -> MemoryProfile:
    """Simulate both allocation regimes over ``plan``'s kernels in order."""
    variables = plan.variables
    managed = {v.name for v in variables.values() if v.kind in ("intermediate", "output")}
    total_managed = sum(variables[n].nbytes for n in managed)

    seen: dict[str, int] = {}
    weights_seen: set[str] = set()
    live = weight_resident = 0
    rows: list[KernelMemory] = []
    for i, k in enumerate(plan.kernels):
        allocated = [n for n in k.accesses if n in managed and n not in seen]
        live += sum(variables[n].nbytes for n in allocated)
        for n in k.accesses:
            seen[n] = seen.get(n, 0) + 1
            if variables[n].kind == "weight" and n not in weights_seen:
                weights_seen.add(n)
                weight_resident += variables[n].nbytes
        freed = [
            n
            for n in k.accesses
            if n in managed and variables[n].kind != "output" and seen[n] == variables[n].expected_accesses
        ]
        rows.append(
            KernelMemory(
                index=i,
                name=k.name,
                op=k.op,
                kind=k.kind,
                output_bytes=sum(variables[n].nbytes for n in k.outputs if n in managed),
                live_eager=live,
                live_no_eager=total_managed,
                weight_resident=weight_resident,
                allocated=allocated,
                freed=freed,
            )
        )
        live -= sum(variables[n].nbytes for n in freed)

    return MemoryProfile(
        model=plan.model,
        batch=plan.batch,
        input_shape=list(plan.input_shape),
        weight_bytes=plan.weight_bytes,
        input_bytes=sum(v.nbytes for v in plan.vars_of_kind("input")),
        output_bytes=sum(v.nbytes for v in plan.vars_of_kind("output")),
        peak_eager=max((r.live_eager for r in rows), default=0),
        peak_no_eager=total_managed if rows else 0,
        kernels=rows,
    )
