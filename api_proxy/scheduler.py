"""The invocation scheduler: a pure policy (no threads, clocks, processes or device calls).

It keeps, per function, the queue of invocations waiting for an instance and the `InstancePool`
(keep-alive, warm limit), and answers every event with the actions the proxy must carry out, the way
vLLM's scheduler returns its outputs for the engine to act on:

- `submit(function, item, now)`: a new invocation -> `Dispatch` (a warm instance), `Start` (a new
  instance, numbered here, for it) or nothing (queued);
- `finished(...)`: an instance is free -> `Dispatch` of the next queued invocation,
  or nothing (it idles);
- `prewarm(function, count, now)`: deploying -> `Start`s with no invocation (instances up before the
  first request; each goes idle when it registers);
- `removed(...)`: an instance is gone -> `Start`s for queued invocations that can now have one;
- `tick(now)`: `Expire`s (queued past their deadline) and `Stop`s (idle past keep-alive);
- `withdraw(abandoned)`: the queued invocations of requests that ended, taken out.

Invocations and instances are opaque here; an invocation only needs a `deadline` attribute.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from .keepalive import DEFAULT_KEEP_ALIVE_S, InstancePool


class Queued(Protocol):
    deadline: float


@dataclass(frozen=True)
class Dispatch:
    """Send `item` to the (warm or just registered) instance `instance`."""

    instance: Hashable
    item: Any


@dataclass(frozen=True)
class Start:
    """Start instance `instance` (a new number) of `function` for `item` (None: a prewarmed instance,
    idle once registered); the pool counts it, busy."""

    function: str
    instance: int
    item: Any


@dataclass(frozen=True)
class Expire:
    """`item` waited in `function`'s queue past its deadline: fail it."""

    function: str
    item: Any


@dataclass(frozen=True)
class Stop:
    """The idle instance `instance` of `function` outlived its keep-alive: stop it."""

    function: str
    instance: Hashable


Action = Dispatch | Start | Expire | Stop


class InvocationScheduler:
    """Queues and instance choice for the functions of one proxy (see the module doc)."""

    def __init__(self, max_instances: dict[str, int], keep_alive_s: float = DEFAULT_KEEP_ALIVE_S) -> None:
        self.pools = {name: InstancePool(n, keep_alive_s) for name, n in max_instances.items()}
        self.queues: dict[str, deque[Any]] = {name: deque() for name in max_instances}
        self._ids = itertools.count(1)

    def _start(self, function: str, item: Any, now: float) -> Start:
        instance = next(self._ids)
        self.pools[function].add(instance, now, busy=True)
        return Start(function, instance, item)

    def submit(self, function: str, item: Queued, now: float) -> Dispatch | Start | None:
        decision = self.pools[function].acquire(now)
        if decision.action == "warm":
            return Dispatch(decision.instance, item)
        if decision.action == "start":
            return self._start(function, item, now)
        self.queues[function].append(item)
        return None

    def prewarm(self, function: str, count: int, now: float) -> list[Start]:
        """Up to `count` instances of `function` started ahead of any request (within its limit)."""
        pool = self.pools[function]
        room = max(0, min(count, pool.max_instances - len(pool)))
        return [self._start(function, None, now) for _ in range(room)]

    def finished(self, function: str, instance: Hashable, now: float) -> Dispatch | None:
        """`instance` is free: the next queued invocation, or None (it idles from `now`)."""
        queue, pool = self.queues[function], self.pools[function]
        if queue:
            pool.reuse(instance, now)
            return Dispatch(instance, queue.popleft())
        pool.release(instance, now)
        return None

    def removed(self, function: str, instance: Hashable, now: float) -> list[Start]:
        """`instance` is gone (died, stopped): queued invocations that may now start instances."""
        pool, queue = self.pools[function], self.queues[function]
        pool.remove(instance)
        starts = []
        while queue and pool.acquire(now).action == "start":
            starts.append(self._start(function, queue.popleft(), now))
        return starts

    def withdraw(self, abandoned: Callable[[Any], bool]) -> list[tuple[str, Any]]:
        """Take every queued invocation for which `abandoned(item)` holds out of the queues (its
        request ended: nobody waits for it); returns them, with their function, for the proxy to fail."""
        out = []
        for function, queue in self.queues.items():
            if any(abandoned(item) for item in queue):
                kept = [item for item in queue if not abandoned(item)]
                out.extend((function, item) for item in queue if abandoned(item))
                queue.clear()
                queue.extend(kept)
        return out

    def retire(self, function: str, instance: Hashable) -> None:
        """Choose idle `instance` no more: the proxy stops it (its exit's `removed` starts what waits)."""
        self.pools[function].remove(instance)

    def tick(self, now: float) -> list[Expire | Stop]:
        """Queued invocations past their deadline (oldest first), then idle instances to stop."""
        actions: list[Expire | Stop] = []
        for function, queue in self.queues.items():
            while queue and now >= queue[0].deadline:
                actions.append(Expire(function, queue.popleft()))
        for function, pool in self.pools.items():
            for instance in pool.expired(now):
                pool.remove(instance)
                actions.append(Stop(function, instance))
        return actions

    def pin(self, pinned: bool, now: float) -> None:
        """While pinned, no instance expires (a deployment's warm-up); unpinning counts the idle
        instances as used at `now`."""
        for pool in self.pools.values():
            if pinned:
                pool.pin()
            else:
                pool.unpin(now)

    def next_due(self) -> float | None:
        """The earliest moment `tick` may have something to do (None: nothing pending)."""
        due: Iterable[float | None] = [
            *(p.next_expiry() for p in self.pools.values()),
            *(q[0].deadline for q in self.queues.values() if q),
        ]
        times = [t for t in due if t is not None]
        return min(times) if times else None

    def summary(self) -> dict[str, dict[str, int]]:
        return {
            name: {
                "instances": len(p),
                "idle": len(p.idle),
                "busy": len(p.busy),
                "queued": len(self.queues[name]),
            }
            for name, p in self.pools.items()
        }
