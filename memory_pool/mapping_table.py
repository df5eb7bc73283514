"""The mapping table of fine-grained memory management (paper section 5.1), and the weight cache.

`MappingTable` records, per (function instance, model, variable), the variable's size, its expected
access count from offline profiling, how often it has been accessed and its device address. The
address stays empty until the first access (lazy allocation: idle variables hold no memory); when
the access count reaches the expected count the variable becomes reclaimable (eager recycling:
spent variables hold no memory). The table never frees anything itself: `reclaim` hands the
reclaimable buffers to the caller, which frees them stream-ordered after the kernel that made the
last access, and `release_instance` hands back everything a finished or crashed instance still
holds, so nothing leaks.

`WeightCache` is the policy for a model's weights, which are shared by every instance running that
model and therefore are not recycled by access count: they stay while any instance uses the model
and for a keep-alive period after the last one leaves (paper: "cache layers in the memory pool as
long as they are accessed"; avoiding repeated loads of a popular model).

Both are pure: no threads, no device calls; time is passed in as `now`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "HeldBuffer",
    "MappingEntry",
    "MappingTable",
    "RecycledAccess",
    "UnknownVariable",
    "WeightCache",
]

Key = tuple[Hashable, str, str]


class UnknownVariable(KeyError):
    """An access to a variable that was never registered for that instance and model."""

    def __str__(self) -> str:  # KeyError would print the message with quotes around it
        return str(self.args[0])


class RecycledAccess(RuntimeError):
    """An access after the variable reached its expected count (its memory may be reused already).

    This means the offline-profiled expected count is wrong for this run: a use-after-free on the
    device, so it is raised instead of silently re-allocating.
    """


@dataclass
class MappingEntry:
    """One row of the mapping table. `expected=None`: never recycled by count (freed on release)."""

    instance: Hashable
    model: str
    var: str
    nbytes: int
    expected: int | None
    accesses: int = 0
    address: int | None = None
    recycled: bool = False


class HeldBuffer(NamedTuple):
    """A device buffer the table hands back to the caller to free.

    A named tuple rather than a frozen dataclass: the executor receives a few of these per kernel,
    and a tuple is built about five times faster.
    """

    instance: Hashable
    model: str
    var: str
    address: int
    nbytes: int


class MappingTable:
    """Variables -> addresses with lazy allocation and eager recycling by expected access count.

    `eager_recycling=False` (the `static` pool mode) keeps every buffer until `release_instance`
    or `reset_instance`: accesses are still counted, nothing becomes reclaimable.
    """

    def __init__(self, eager_recycling: bool = True) -> None:
        self.eager_recycling = eager_recycling
        self._entries: dict[Key, MappingEntry] = {}
        self._by_instance: dict[Hashable, dict[Key, MappingEntry]] = {}
        self._pending: dict[Key, MappingEntry] = {}  # reached expected count, not yet reclaimed
        self._held_bytes = 0
        self._peak_held_bytes = 0
        self.touched_bytes = 0  # held during the last `touch_recycling`'s kernel (its spent rows included)
        self.allocations = 0  # buffers allocated so far (first accesses and `materialize`)

    # -- registration ---------------------------------------------------------------------------
    def register(
        self, instance: Hashable, model: str, var: str, nbytes: int, expected: int | None
    ) -> None:
        """Declare a variable of `instance`'s run of `model`; no memory is allocated yet (lazy).

        `expected` is the profiled number of accesses after which the variable is dead, or None for
        a buffer whose lifetime is decided elsewhere (e.g. an output handed to `put`).
        """
        if nbytes < 0:
            raise ValueError(f"{model}/{var}: negative size {nbytes}")
        if expected is not None and expected < 1:
            raise ValueError(f"{model}/{var}: expected accesses must be >= 1 or None, got {expected}")
        key = (instance, model, var)
        if key in self._entries:
            raise ValueError(f"{model}/{var} is already registered for instance {instance!r}")
        entry = MappingEntry(instance, model, var, nbytes, expected)
        self._entries[key] = entry
        self._by_instance.setdefault(instance, {})[key] = entry

    def register_many(
        self, instance: Hashable, model: str, variables: Iterable[tuple[str, int, int | None]]
    ) -> None:
        """`register` each (var, nbytes, expected) of a kernel plan."""
        for var, nbytes, expected in variables:
            self.register(instance, model, var, nbytes, expected)

    # -- the executor's hot path ----------------------------------------------------------------
    def access(
        self, instance: Hashable, model: str, var: str, allocate: Callable[[int], int]
    ) -> int:
        """Count one access and return the variable's address, allocating it on first access.

        `allocate(nbytes)` is called only on the first access; if it raises, the table is
        unchanged (no access counted), so the caller may grow the pool and retry. An access that
        reaches the expected count queues the buffer for `reclaim`.
        """
        key = (instance, model, var)
        entry = self._entries.get(key)
        if entry is None:
            known = sorted(v for (i, m, v) in self._by_instance.get(instance, {}) if m == model)
            raise UnknownVariable(
                f"variable {var!r} of model {model!r} is not registered for instance {instance!r}"
                f" (registered: {known[:20]}{' ...' if len(known) > 20 else ''})"
            )
        return self.touch((entry,), allocate)[0]

    def touch(self, entries: Sequence[MappingEntry], allocate: Callable[[int], int]) -> list[int]:
        """`access` for each row of `entries` in order; returns their addresses.

        The executor's per-kernel call: it looks the rows of each kernel up once per instance
        (`rows`), so a kernel costs no lookup by name here. Same rules as `access`, row by row: an
        allocation that raises leaves that row uncounted (the rows before it are counted).
        """
        return self._touch(entries, allocate, None)

    def touch_recycling(
        self, entries: Sequence[MappingEntry], allocate: Callable[[int], int], spent: list[int]
    ) -> list[int]:
        """`touch`, recycling at once: the address of each row whose access reaches its expected
        count is appended to `spent` (the caller frees it after the kernel) instead of being queued
        for `reclaim`. The executor's per-kernel call when it recycles at the kernel boundary: no
        queue, no `HeldBuffer` per spent row. Same rules and errors as `touch`. The spent rows are
        live while the kernel runs: `touched_bytes` is what the table held for it (spent included)."""
        return self._touch(entries, allocate, spent)

    def _touch(
        self, entries: Sequence[MappingEntry], allocate: Callable[[int], int], spent: list[int] | None
    ) -> list[int]:
        addresses = []
        eager = self.eager_recycling
        freed = 0
        for entry in entries:
            expected = entry.expected
            if entry.recycled or (eager and expected is not None and entry.accesses >= expected):
                raise RecycledAccess(
                    f"{entry.model}/{entry.var} of instance {entry.instance!r} accessed {entry.accesses + 1}"
                    f" times, expected {expected}: its buffer is already recycled"
                )
            address = entry.address
            if address is None:
                address = entry.address = allocate(entry.nbytes)
                self.allocations += 1
                self._held_bytes += entry.nbytes
                if self._held_bytes > self._peak_held_bytes:
                    self._peak_held_bytes = self._held_bytes
            accesses = entry.accesses = entry.accesses + 1
            if eager and accesses == expected:
                if spent is None:
                    self._pending[(entry.instance, entry.model, entry.var)] = entry
                else:
                    entry.address = None
                    entry.recycled = True
                    freed += entry.nbytes
                    spent.append(address)
            addresses.append(address)
        self.touched_bytes = self._held_bytes
        self._held_bytes -= freed
        return addresses

    # -- the executor's scheduled path (an `AccessSchedule` decided the moments once per plan) ----
    def place(self, entries: Sequence[MappingEntry], addresses: Sequence[int]) -> int:
        """Rows allocated at their first access, their addresses given (the schedule's `first`);
        returns the bytes held now. Access counts are implied by the schedule and not kept per row on
        this path."""
        held = self._held_bytes
        for entry, address in zip(entries, addresses, strict=True):
            entry.address = address
            held += entry.nbytes
        self.allocations += len(entries)
        self._held_bytes = held
        if held > self._peak_held_bytes:
            self._peak_held_bytes = held
        return held

    def retire(self, entries: Sequence[MappingEntry], spent: list[int]) -> None:
        """Rows whose last expected access was just issued (the schedule's `last`): recycled, their
        addresses appended to `spent` for the caller to free stream-ordered (as `touch_recycling`)."""
        held = self._held_bytes
        for entry in entries:
            spent.append(entry.address)  # type: ignore[arg-type]  # placed by this run
            entry.address = None
            entry.recycled = True
            held -= entry.nbytes
        self._held_bytes = held

    def reclaim(self) -> list[HeldBuffer]:
        """Hand over every buffer that reached its expected count since the last call.

        The table forgets these addresses (the variables are marked recycled); the caller must
        free each one, after the work that made its last access (stream order).
        """
        if not self._pending:
            return []
        out = [self._take(entry) for entry in self._pending.values()]
        self._pending.clear()
        return out

    @property
    def pending_reclaim(self) -> int:
        """How many buffers `reclaim` would hand over now."""
        return len(self._pending)

    # -- instance lifecycle ---------------------------------------------------------------------
    def release_instance(self, instance: Hashable) -> list[HeldBuffer]:
        """Remove every entry of `instance` and return every buffer it still holds.

        For a finished or crashed instance: whatever it did not consume is handed back, so a failed
        function leaks nothing. Unknown instances yield an empty list.
        """
        entries = self._by_instance.pop(instance, {})
        out = []
        for key, entry in entries.items():
            del self._entries[key]
            self._pending.pop(key, None)
            if entry.address is not None:
                out.append(self._take(entry))
        return out

    def reset_instance(self, instance: Hashable) -> list[HeldBuffer]:
        """Keep `instance`'s registrations but return its buffers and zero its counts.

        For a warm instance that runs the same plan again for its next request.
        """
        out = []
        for key, entry in self._by_instance.get(instance, {}).items():
            self._pending.pop(key, None)
            if entry.address is not None:
                out.append(self._take(entry))
            entry.accesses = 0
            entry.recycled = False
        return out

    def detach(self, instance: Hashable, model: str, var: str) -> HeldBuffer | None:
        """Hand a variable's buffer over to the caller, who frees it (e.g. a run's output).

        The table forgets the address (the variable is marked recycled until `reset_instance`), so
        neither `reclaim` nor `release_instance` returns it again. None if it holds no buffer.
        """
        entry = self.entry(instance, model, var)
        if entry.address is None:
            return None
        self._pending.pop((instance, model, var), None)
        return self._take(entry)

    def materialize(self, instance: Hashable, allocate: Callable[[int], int]) -> int:
        """Allocate every not-yet-allocated variable of `instance` now; returns the bytes allocated.

        For pool modes without lazy allocation (the `static` baseline allocates up front).
        """
        total = 0
        for entry in self._by_instance.get(instance, {}).values():
            if entry.address is None and not entry.recycled:
                entry.address = allocate(entry.nbytes)
                self.allocations += 1
                self._held_bytes += entry.nbytes
                total += entry.nbytes
        if self._held_bytes > self._peak_held_bytes:
            self._peak_held_bytes = self._held_bytes
        return total

    def _take(self, entry: MappingEntry) -> HeldBuffer:
        assert entry.address is not None
        held = HeldBuffer(entry.instance, entry.model, entry.var, entry.address, entry.nbytes)
        entry.address = None
        entry.recycled = True
        self._held_bytes -= entry.nbytes
        return held

    # -- inspection -----------------------------------------------------------------------------
    def entry(self, instance: Hashable, model: str, var: str) -> MappingEntry:
        """The row of a variable (a live object: do not mutate)."""
        try:
            return self._entries[(instance, model, var)]
        except KeyError:
            raise UnknownVariable(
                f"variable {var!r} of model {model!r} is not registered for instance {instance!r}"
            ) from None

    def rows(self, instance: Hashable, model: str, variables: Iterable[str]) -> list[MappingEntry]:
        """The rows of `variables` (live objects, valid until `release_instance`), for `touch`."""
        return [self.entry(instance, model, var) for var in variables]

    def entries(self, instance: Hashable) -> list[MappingEntry]:
        """Rows of `instance`, in registration order."""
        return list(self._by_instance.get(instance, {}).values())

    def instances(self) -> list[Hashable]:
        """Instances with at least one registered variable."""
        return list(self._by_instance)

    @property
    def held_bytes(self) -> int:
        """Requested bytes of every buffer allocated and not yet handed back (pending included)."""
        return self._held_bytes

    @property
    def peak_held_bytes(self) -> int:
        """Maximum of `held_bytes` so far."""
        return self._peak_held_bytes

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class _ModelUse:
    users: int = 0
    idle_since: float | None = None


class WeightCache:
    """Reference counts of shared model weights, with keep-alive after the last user leaves.

    Decides only: the caller loads weights when `acquire` says the model is new, and frees the
    weights of the models `expired` names, then calls `evict`.
    """

    def __init__(self) -> None:
        self._models: dict[str, _ModelUse] = {}

    def acquire(self, model: str, now: float) -> bool:
        """One more instance uses `model`. True when the model was not cached (load its weights)."""
        use = self._models.get(model)
        is_new = use is None
        if use is None:
            use = self._models[model] = _ModelUse()
        use.users += 1
        use.idle_since = None
        return is_new

    def release(self, model: str, now: float) -> int:
        """One instance stops using `model`; returns the users left. The weights stay cached."""
        use = self._models.get(model)
        if use is None or use.users == 0:
            raise ValueError(f"release of model {model!r} without a matching acquire")
        use.users -= 1
        if use.users == 0:
            use.idle_since = now
        return use.users

    def users(self, model: str) -> int:
        """Instances using `model` now (0 for an idle or unknown model)."""
        use = self._models.get(model)
        return use.users if use else 0

    def idle_since(self, model: str) -> float | None:
        """When the last user of a cached model left; None while it has users (or is unknown)."""
        use = self._models.get(model)
        return use.idle_since if use else None

    def expired(self, now: float, keep_alive_s: float) -> list[str]:
        """Models idle for longer than `keep_alive_s` (strictly), oldest first; never one in use."""
        if keep_alive_s < 0:
            raise ValueError(f"keep_alive_s must be >= 0, got {keep_alive_s}")
        idle = [
            (use.idle_since, model)
            for model, use in self._models.items()
            if use.users == 0 and use.idle_since is not None and now - use.idle_since > keep_alive_s
        ]
        return [model for _, model in sorted(idle)]

    def restart_idle(self, now: float) -> None:
        """Every idle model counts as idle from `now` (a warm-up that was not idle time ended)."""
        for use in self._models.values():
            if use.idle_since is not None:
                use.idle_since = max(use.idle_since, now)

    def evict(self, model: str) -> None:
        """Forget a model whose weights the caller has freed; refuses a model with users."""
        use = self._models.get(model)
        if use is None:
            raise KeyError(f"model {model!r} is not cached; cached: {sorted(self._models)}")
        if use.users:
            raise ValueError(f"model {model!r} still has {use.users} users and cannot be evicted")
        del self._models[model]

    def models(self) -> list[str]:
        """Every cached model, in use or idle."""
        return list(self._models)

    def __contains__(self, model: object) -> bool:
        return model in self._models
