"""The elastic communication store's placement and movement rules (paper section 6.2), pure.

No threads, no clocks, no device calls: the store shell describes each GPU (`GpuState`: how many bytes
the store may hold there now, and how many it holds) and each stored item (`ItemState`), and these
functions answer where new data goes and which data moves where.

Capacity (pressure awareness, PA). The store may hold `capacity_fraction` of the idle memory that the
memory pool's demand model predicts for the next window (20 ms by default: the PCIe transfer time of
200 MB), see `store_capacity`. Without PA the store does not watch pressure: its capacity is a static
figure (unbounded by default) and data leaves a GPU only when an allocation fails and the memory pool
asks the store to `reclaim` bytes (the shell turns that into `need`).

Movement (adaptive movement, AM). A GPU whose stored bytes exceed its capacity (plus any `need`)
sheds data:
- Rule 3, largest first: victims are taken in decreasing size (ties: older PUT first, then key) until
  the excess is covered, so that memory returns to running functions with the fewest copies. Items a
  reader currently holds (`movable=False`) stay: moving them would not free their bytes.
- Rule 1, to the remote reader: an item last read from another GPU goes to that GPU if it fits there.
- Rule 2, lowest pressure: otherwise to the GPU whose fill ratio (stored + incoming + item) / capacity
  would be lowest (ties: lowest index), among the GPUs where it fits. "Fits" means the target stays
  within its capacity, so a move never pushes another GPU over.
- Host memory when no GPU fits.
With AM off every victim goes to host memory (the paper's "w/o AM": data copied out over PCIe).

Rule 1 also acts at GET time (`relocate_on_read`): with AM on, when data is read from another GPU (or
from host memory) and more reads are expected, the copy made for the reader becomes the stored copy
on the reader's GPU (if it fits there), so later readers on that GPU take it without a copy.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from .tables import HOST

__all__ = [
    "HOST",
    "GpuState",
    "ItemState",
    "Move",
    "expired",
    "place",
    "plan_moves",
    "relocate_on_read",
    "store_capacity",
]

RULE_READER = "rule1-reader"
RULE_EVEN = "rule2-lowest-pressure"
RULE_HOST = "host-all-full"
RULE_HOST_NO_AM = "host-am-off"
RULE_HOME = "home"


def store_capacity(idle_bytes: float, fraction: float) -> float:
    """Bytes the store may hold on a GPU: `fraction` of its predicted idle memory (0 when none)."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"capacity fraction must be in [0, 1], got {fraction}")
    if math.isinf(idle_bytes):
        return math.inf if idle_bytes > 0 else 0
    return math.floor(max(0.0, idle_bytes) * fraction)


@dataclass(frozen=True)
class GpuState:
    index: int
    capacity: float  # bytes the store may hold here now; math.inf: unbounded
    used: int  # bytes the store holds here now

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"GPU index must be >= 0, got {self.index}")
        if self.capacity < 0 or self.used < 0:
            raise ValueError(f"GPU {self.index}: negative capacity or usage ({self.capacity}, {self.used})")


@dataclass(frozen=True)
class ItemState:
    key: str
    nbytes: int
    location: int  # GPU index or HOST
    seq: int  # PUT order: smaller is older
    last_reader: int | None = None  # GPU of the latest read from another location
    movable: bool = True  # False while a reader holds its bytes or a transfer reads them


@dataclass(frozen=True)
class Move:
    key: str
    src: int
    dst: int  # GPU index or HOST
    nbytes: int
    rule: str


class _Room:
    """Capacities and usages as the plan goes (a move changes two of them)."""

    def __init__(self, gpus: Iterable[GpuState]) -> None:
        self.capacity: dict[int, float] = {}
        self.used: dict[int, int] = {}
        for g in gpus:
            if g.index in self.capacity:
                raise ValueError(f"GPU {g.index} described twice")
            self.capacity[g.index] = g.capacity
            self.used[g.index] = g.used

    def fits(self, gpu: int, nbytes: int) -> bool:
        return self.used[gpu] + nbytes <= self.capacity[gpu]

    def fill_after(self, gpu: int, nbytes: int) -> float:
        cap = self.capacity[gpu]
        return 0.0 if math.isinf(cap) else (self.used[gpu] + nbytes) / cap

    def lowest_pressure(self, nbytes: int, exclude: int) -> int | None:
        fitting = [g for g in self.capacity if g != exclude and self.fits(g, nbytes)]
        if not fitting:
            return None
        return min(fitting, key=lambda g: (self.fill_after(g, nbytes), g))

    def move(self, src: int, dst: int, nbytes: int) -> None:
        if src != HOST:
            self.used[src] -= nbytes
        if dst != HOST:
            self.used[dst] += nbytes


def place(nbytes: int, home: int, gpus: Sequence[GpuState], adaptive: bool) -> tuple[int, str]:
    """Where new data of `nbytes` goes: its producer's GPU if it fits, else by rule 2 (AM on), else host."""
    room = _Room(gpus)
    if home not in room.capacity:
        raise ValueError(f"home GPU {home} is not among the described GPUs {sorted(room.capacity)}")
    if room.fits(home, nbytes):
        return home, RULE_HOME
    if not adaptive:
        return HOST, RULE_HOST_NO_AM
    target = room.lowest_pressure(nbytes, exclude=home)
    return (target, RULE_EVEN) if target is not None else (HOST, RULE_HOST)


def _destination(item: ItemState, room: _Room, adaptive: bool) -> tuple[int, str]:
    if not adaptive:
        return HOST, RULE_HOST_NO_AM
    reader = item.last_reader
    if (
        reader is not None
        and reader != item.location
        and reader in room.capacity
        and room.fits(reader, item.nbytes)
    ):
        return reader, RULE_READER
    target = room.lowest_pressure(item.nbytes, exclude=item.location)
    return (target, RULE_EVEN) if target is not None else (HOST, RULE_HOST)


def over_capacity(gpus: Iterable[GpuState]) -> bool:
    """Whether any GPU holds more than its capacity: without bytes asked for (`need`), `plan_moves`
    moves nothing otherwise (the store's ticker asks this first, before describing every item)."""
    return any(g.used > g.capacity for g in gpus)


def plan_moves(
    gpus: Sequence[GpuState],
    items: Iterable[ItemState],
    *,
    adaptive: bool,
    need: Mapping[int, int] | None = None,
) -> list[Move]:
    """The moves that bring every GPU back within its capacity (plus `need` extra bytes), in order.

    GPUs are relieved in index order. A GPU may stay over when its movable items do not cover the
    excess (the plan moves all of them).
    """
    room = _Room(gpus)
    need = dict(need or {})
    unknown = sorted(set(need) - set(room.capacity))
    if unknown:
        raise ValueError(f"need given for undescribed GPUs {unknown}")
    by_gpu: dict[int, list[ItemState]] = {g: [] for g in room.capacity}
    for item in items:
        if item.location != HOST and item.movable:
            if item.location not in by_gpu:
                raise ValueError(f"item {item.key!r} is on undescribed GPU {item.location}")
            by_gpu[item.location].append(item)
    moves: list[Move] = []
    for gpu in sorted(room.capacity):
        excess = max(0.0, room.used[gpu] - room.capacity[gpu]) + need.get(gpu, 0)
        if excess <= 0:
            continue
        freed = 0
        for item in sorted(by_gpu[gpu], key=lambda it: (-it.nbytes, it.seq, it.key)):
            if freed >= excess:
                break
            dst, rule = _destination(item, room, adaptive)
            moves.append(Move(item.key, gpu, dst, item.nbytes, rule))
            room.move(gpu, dst, item.nbytes)
            freed += item.nbytes
    return moves


def relocate_on_read(
    item: ItemState,
    reader: int,
    gpus: Sequence[GpuState],
    *,
    adaptive: bool,
    reads_left: int | None,
) -> bool:
    """Rule 1 at GET time: should the copy made for a reader on another GPU become the stored copy?

    Yes when AM is on, the data is not on the reader's GPU, more reads are expected (`reads_left` is
    None for "unknown" or > 0), and the reader's GPU has room for it within its capacity.
    """
    if not adaptive or item.location == reader or reads_left == 0:
        return False
    room = _Room(gpus)
    return reader in room.capacity and room.fits(reader, item.nbytes)


K = TypeVar("K", bound=Hashable)


def expired(deadlines: Mapping[K, float | None], now: float) -> list[K]:
    """Keys whose deadline has passed at `now` (a deadline equal to `now` has passed), in
    deadline order (ties: insertion order). None never expires."""
    due = [(d, i, k) for i, (k, d) in enumerate(deadlines.items()) if d is not None and d <= now]
    return [k for _, _, k in sorted(due, key=lambda t: (t[0], t[1]))]
