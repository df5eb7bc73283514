"""Which `infer` calls of one batched message run as one inference: a pure policy.

The monolithic invoker sends an instance the invocations of one function it gathered (up to
`max_batch_size` samples, `monolithic.py`); the instance runs their handlers concurrently and their
`infer` calls meet here. A call joins the open group of its *kind* (model, per-sample input shape)
through `api_proxy.batcher.Gatherer` with the function's `Limits`, so a group never holds more than
`max_samples` samples and a call that would overflow it closes it first. A group closes:

- when full (`max_samples`), as in the proxy;
- as soon as no member of the message could still join: every member whose handler still runs is
  waiting in a group (members whose group is running, and finished members, cannot join). This is
  the usual way a group closes, without waiting: the members were sent together;
- at the latest `max_delay_s` after its first call (a member blocked elsewhere, e.g. in a GET for a
  key another member puts after its own `infer`, costs the others at most that).

No clock, no threads, no device: every method takes `now` where it matters and returns the groups it
closed; the instance's threads (`instance_batching.py`) wait on a condition until their group closes.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Generic, TypeVar

from streambox.api_proxy.batcher import Batch, Gatherer, Limits

T = TypeVar("T")


class InferGroups(Generic[T]):
    """The open infer groups of one message's `members` concurrent handlers (see the module)."""

    def __init__(self, members: int, limits: Limits) -> None:
        if members < 1:
            raise ValueError(f"a message has at least one member, got {members}")
        self.limits = limits
        self.outside = members  # handlers running their own code: they may still join a group
        self._gatherer: Gatherer[T] = Gatherer()

    def join(self, kind: Hashable, call: T, samples: int, now: float) -> list[Batch[T]]:
        """`call` (of `samples` samples, from a member now waiting) joins its kind's open group;
        returns the groups this closed."""
        self.outside -= 1
        _, closed = self._gatherer.add(kind, call, samples, self.limits, now)
        return closed + self._if_nobody_left()

    def resumed(self, members: int) -> None:
        """`members` handlers whose group ran go on with their own code (they may join again)."""
        self.outside += members

    def finished(self) -> list[Batch[T]]:
        """A member's handler returned (or raised): the groups this closed."""
        self.outside -= 1
        return self._if_nobody_left()

    def due(self, now: float) -> list[Batch[T]]:
        """The groups whose deadline has come, closed."""
        return self._gatherer.due(now)

    def next_deadline(self) -> float | None:
        return self._gatherer.next_deadline()

    def __len__(self) -> int:
        return len(self._gatherer)

    def _if_nobody_left(self) -> list[Batch[T]]:
        """Every open group, closed, when no member could join one any more."""
        if self.outside < 0:
            raise RuntimeError("more members waiting or finished than the message has")
        return self._gatherer.due(math.inf) if self.outside == 0 else []
