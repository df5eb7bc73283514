"""The memory-pool ablation modes of the paper's Fig. 15: static -> +FM -> +FM+RS (StreamBox)."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["PoolMode"]


class PoolMode(StrEnum):
    """Which memory-management mechanisms a pool runs with.

    - `static`: a caching pool that grows on demand and never gives memory back, allocating each
      variable of a run up front and keeping it until the run ends (cudaMemPool / PyTorch caching
      allocator): the stream-only baseline.
    - `fm`: fine-grained memory management: lazy allocation on first access and eager recycling
      at the expected access count; the pool still grows on demand and never shrinks.
    - `fm+rs`: StreamBox: FM plus resilient scaling (Algorithm 1) that also shrinks the pool.
    """

    STATIC = "static"
    FM = "fm"
    FM_RS = "fm+rs"

    @classmethod
    def parse(cls, text: str) -> PoolMode:
        """The mode named `text` (case and surrounding spaces ignored); the error lists the choices."""
        value = text.strip().lower()
        for mode in cls:
            if mode.value == value:
                return mode
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"unknown memory-pool mode {text!r}; allowed: {allowed}")

    @property
    def lazy(self) -> bool:
        """Allocate a variable at its first access rather than when the instance starts."""
        return self is not PoolMode.STATIC

    @property
    def eager_recycling(self) -> bool:
        """Free a variable as soon as it reached its profiled expected access count."""
        return self is not PoolMode.STATIC

    @property
    def resilient_scaling(self) -> bool:
        """Resize (grow and shrink) the pool to the profiled demand of the next interval."""
        return self is PoolMode.FM_RS
