"""Idle memory for the communication store, from the memory pool's demand model (paper section 6.2).

The store may hold a fraction of "the idle memory that the memory pool's demand model predicts over
a 20 ms window". Idle means device memory that nothing but the store will need in
[now, now + window]:

    idle = (device free + pool reserved)           every byte the pool has or could get
         - (pool demand - functions' held - store)  held outside the profiles: weights, inputs,
                                                    outputs, unprofiled functions (held, not predicted)
         - sum over running functions of max(held, m_next)
                                                    what each function holds now or will need in the
                                                    window, by Algorithm 1's demand model
    never below 0.

The store's own bytes are *not* subtracted: the store compares its usage with its capacity (see
`comm.policy`), so subtracting them would make it shrink itself. Growing or trimming the pool moves
bytes between "device free" and "pool reserved" and leaves `idle` unchanged: the scaler and the
store do not chase each other.

`predict_idle_bytes` is the pure rule; `PoolIdleMemory` is the thin shell that reads one GPU's pool,
its position board and the scaler's profiles, and is the store's `idle(gpu, now, window)` for that
GPU. `now` must be on the board's clock (`time.perf_counter`, as the executor writes positions).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from streambox.device.base import Runtime

from .scaler import PositionBoard, ResilientScaler
from .scaling import FunctionPosition, ModelProfile, ProfileKey, function_demands

__all__ = ["FunctionNeed", "PoolIdleMemory", "function_needs", "predict_idle_bytes"]


@dataclass(frozen=True)
class FunctionNeed:
    """One running function: bytes it holds now, and what the demand model says it needs in the window
    (None: no profile, so only what it holds counts)."""

    instance: Hashable
    held_bytes: int
    next_bytes: int | None = None

    @property
    def need_bytes(self) -> int:
        return self.held_bytes if self.next_bytes is None else max(self.held_bytes, self.next_bytes)


def predict_idle_bytes(
    device_free: int,
    pool_reserved: int,
    pool_demand: int,
    store_bytes: int,
    functions: Iterable[FunctionNeed],
) -> int:
    """Bytes of one GPU that nothing but the store needs over the window (module formula), >= 0.

    `store_bytes`: the store's bytes counted in `pool_demand` (0 when the store allocates elsewhere).
    """
    if min(device_free, pool_reserved, pool_demand, store_bytes) < 0:
        raise ValueError(
            f"negative byte count: free {device_free}, reserved {pool_reserved}, demand {pool_demand}, "
            f"store {store_bytes}"
        )
    held = need = 0
    for f in functions:
        held += f.held_bytes
        need += f.need_bytes
    other = max(0, pool_demand - store_bytes - held)
    return max(0, device_free + pool_reserved - other - need)


def function_needs(
    now: float,
    board: Iterable[tuple[FunctionPosition, int]],
    profiles: Mapping[ProfileKey, ModelProfile],
    window_s: float,
) -> list[FunctionNeed]:
    """The running functions' needs over [now, now + window_s]: Algorithm 1's m_next for the profiled
    ones (`scaling.function_demands`), what they hold for the others."""
    entries = list(board)
    profiled = [(pos, held) for pos, held in entries if pos.key in profiles]
    demands = function_demands(now, [pos for pos, _ in profiled], profiles, window_s)
    pairs = zip(profiled, demands, strict=True)
    needs = [FunctionNeed(pos.instance, held, d.next_bytes) for (pos, held), d in pairs]
    needs += [FunctionNeed(pos.instance, held) for pos, held in entries if pos.key not in profiles]
    return needs


class _Pool(Protocol):
    runtime: Runtime

    @property
    def reserved_bytes(self) -> int: ...

    @property
    def demand_bytes(self) -> int: ...


Profiles = ResilientScaler | Mapping[ProfileKey, ModelProfile] | None


class PoolIdleMemory:
    """The store's idle-memory predictor for the GPU of `pool` (a `DeviceMemoryPool`).

    `profiles`: the `ResilientScaler` whose profiles to use (it learns new ones as functions start),
    a fixed mapping, or None (pool modes without scaling: every function counts what it holds).
    `store_bytes()`: the store's bytes in this pool; set it once the store exists, e.g.
    `idle.store_bytes = lambda: store.usage()[gpu]` (default: none, for a store allocating elsewhere).
    """

    def __init__(
        self,
        pool: _Pool,
        board: PositionBoard,
        profiles: Profiles = None,
        *,
        store_bytes: Callable[[], int] | None = None,
    ) -> None:
        self.pool = pool
        self.board = board
        self._profiles = profiles
        self.store_bytes: Callable[[], int] = store_bytes or (lambda: 0)

    @property
    def profiles(self) -> Mapping[ProfileKey, ModelProfile]:
        p = self._profiles
        if p is None:
            return {}
        return p.profiles if isinstance(p, ResilientScaler) else p

    def needs(self, now: float, window_s: float) -> list[FunctionNeed]:
        return function_needs(now, self.board.snapshot(), self.profiles, window_s)

    def __call__(self, gpu: int, now: float, window_s: float) -> int:
        """`comm.IdlePredictor`: idle bytes of this pool's GPU over [now, now + window_s]."""
        needs = self.needs(now, window_s)  # before the pool figures: a run may end meanwhile
        free, _total = self.pool.runtime.memory_info()
        return predict_idle_bytes(
            free, self.pool.reserved_bytes, self.pool.demand_bytes, self.store_bytes(), needs
        )
