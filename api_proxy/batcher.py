"""Gathering concurrent inferences into batches: a pure policy (Triton's dynamic batcher is the model).

An inference that may be batched joins the open batch of its *kind* (the proxy uses: function, model,
per-sample input shapes and dtypes). The open batch closes when its samples reach the function's
`max_samples`, when it holds `max_members` members (where the caller knows that no more can be
waiting at once: the proxy's instances run one invocation each, so a batch holding `max_instances`
calls cannot grow), or at its deadline: `max_delay_s` after its first member arrived. A member that
would overflow the open batch closes it first and opens the next one (Triton does the same), so no
batch ever holds more than `max_samples` samples and no member waits longer than `max_delay_s`. A
member whose caller stopped waiting `leave`s its open batch, taking its samples out: they no longer
fill the batch for the members still waiting.

No clock, no threads, no device: `add` and `due` take `now` and return the batches they closed; the
caller (the proxy's dispatcher) calls `due` from its timers and sleeps no longer than `next_deadline`.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Limits:
    """One function's batching settings: samples per batch, how long a batch stays open, and how many
    members can be waiting at once (None: no bound the caller knows of)."""

    max_samples: int
    max_delay_s: float
    max_members: int | None = None

    def __post_init__(self) -> None:
        too_few = self.max_members is not None and self.max_members < 1
        if self.max_samples < 1 or self.max_delay_s < 0 or too_few:
            raise ValueError(
                f"batch limits need max_samples >= 1, max_delay_s >= 0 and max_members >= 1, got {self}"
            )

    def full(self, batch: Batch[Any]) -> bool:
        """Whether `batch` cannot take another member."""
        most = self.max_members
        return batch.total >= self.max_samples or (most is not None and len(batch.members) >= most)


@dataclass(eq=False)
class Batch(Generic[T]):
    """Members gathered for one inference, in arrival order (the first is the one that runs it)."""

    kind: Hashable
    deadline: float
    members: list[T] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)  # per member

    @property
    def total(self) -> int:
        return sum(self.samples)

    @property
    def leader(self) -> T:
        return self.members[0]

    def hand_on(self, gone: T, successor: T) -> None:
        """`gone` leaves the batch and `successor`, one of its members, leads it instead."""
        i = self.members.index(gone)
        del self.members[i], self.samples[i]
        j = self.members.index(successor)
        self.members.insert(0, self.members.pop(j))
        self.samples.insert(0, self.samples.pop(j))


class Gatherer(Generic[T]):
    """The open batch of every kind (see the module doc)."""

    def __init__(self) -> None:
        self._open: dict[Hashable, Batch[T]] = {}

    def add(
        self, kind: Hashable, member: T, samples: int, limits: Limits, now: float
    ) -> tuple[Batch[T], list[Batch[T]]]:
        """`member` (of `samples` samples) joins its kind's open batch. Returns the batch it joined and
        the batches this arrival closed (the previous one it would overflow, its own once full)."""
        if samples < 1:
            raise ValueError(f"a member brings at least one sample, got {samples}")
        closed: list[Batch[T]] = []
        batch = self._open.get(kind)
        if batch is not None and batch.total + samples > limits.max_samples:
            closed.append(self._open.pop(kind))
            batch = None
        if batch is None:
            batch = self._open[kind] = Batch(kind, now + limits.max_delay_s)
        batch.members.append(member)
        batch.samples.append(samples)
        if limits.full(batch) or now >= batch.deadline:
            closed.append(self._open.pop(kind))
        return batch, closed

    def leave(self, batch: Batch[T], member: T) -> bool:
        """`member` leaves `batch` while it is open (its caller stopped waiting), its samples with it;
        an open batch left empty is dropped. False when the batch closed already (its runner leaves
        out the members that ended) or `member` is not in it."""
        if not self.is_open(batch) or member not in batch.members:
            return False
        i = batch.members.index(member)
        del batch.members[i], batch.samples[i]
        if not batch.members:
            del self._open[batch.kind]
        return True

    def due(self, now: float) -> list[Batch[T]]:
        """The open batches whose deadline has come, closed (earliest deadline first)."""
        ready = sorted((b for b in self._open.values() if now >= b.deadline), key=lambda b: b.deadline)
        for batch in ready:
            del self._open[batch.kind]
        return ready

    def next_deadline(self) -> float | None:
        return min((b.deadline for b in self._open.values()), default=None)

    def open_batch(self, kind: Hashable) -> Batch[T] | None:
        """The open batch of `kind`, if any."""
        return self._open.get(kind)

    def is_open(self, batch: Batch[T]) -> bool:
        """Whether `batch` still takes members (neither closed nor discarded)."""
        return self._open.get(batch.kind) is batch

    def discard(self, batch: Batch[T]) -> bool:
        """Close `batch` unrun (its leader is gone); True if it was still open."""
        if self._open.get(batch.kind) is batch:
            del self._open[batch.kind]
            return True
        return False

    def __len__(self) -> int:
        return len(self._open)
