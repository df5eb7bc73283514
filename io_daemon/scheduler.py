"""The block scheduler (pure): per-function queues, a round-robin device queue, preemption, batches.

Paper section 7 (Fig. 9). Each function has a FIFO queue of its blocks. The global device queue is fed
round-robin from the functions that are *admitted*: one block per function per turn. Requests that
arrive while a batch is being transferred wait in the preemption module; at the next batch boundary
(`next_batch`) the functions that were not yet in the round-robin ring join it at its head, so they
are served first in that batch and then take their fair turn. A function whose queue runs dry leaves
the ring; its next request arrives as a newcomer again.

Nothing here knows about threads, time or devices: `submit` records an arrival, `next_batch` is the
decision taken at a batch boundary. With batching off (BT off) the batch is one block.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable

from .blocks import Block

#: The paper's batch: six 2 MB blocks per issue.
DEFAULT_BATCH_BLOCKS = 6


class BlockScheduler:
    def __init__(self, batch_blocks: int = DEFAULT_BATCH_BLOCKS) -> None:
        if batch_blocks < 1:
            raise ValueError(f"a batch needs at least one block, got {batch_blocks}")
        self.batch_blocks = batch_blocks
        self._queues: dict[Hashable, deque[Block]] = {}
        self._ring: deque[Hashable] = deque()  # admitted functions; the head is served next
        self._arrivals: list[Hashable] = []  # the preemption module: functions waiting to join
        self.batches = 0

    def submit(self, function: Hashable, blocks: Iterable[Block]) -> None:
        """A function's new blocks. A function not in the ring joins it at the next batch boundary."""
        blocks = list(blocks)
        if not blocks:
            return
        queue = self._queues.setdefault(function, deque())
        if queue and queue[-1].seq >= blocks[0].seq:
            raise ValueError(f"function {function!r}: block seq {blocks[0].seq} after {queue[-1].seq}")
        queue.extend(blocks)
        if function not in self._ring and function not in self._arrivals:
            self._arrivals.append(function)

    def next_batch(self) -> list[Block]:
        """At a batch boundary: admit newcomers at the head of the ring, then take up to
        `batch_blocks` blocks round-robin, one per function per turn."""
        for function in reversed(self._arrivals):
            self._ring.appendleft(function)
        self._arrivals.clear()
        batch: list[Block] = []
        while self._ring and len(batch) < self.batch_blocks:
            function = self._ring.popleft()
            queue = self._queues[function]
            batch.append(queue.popleft())
            if queue:
                self._ring.append(function)
            else:
                del self._queues[function]
        if batch:
            self.batches += 1
        return batch

    def cancel(self, function: Hashable) -> list[Block]:
        """Drop a function's queued blocks (its transfer failed or it went away); returns them."""
        dropped = list(self._queues.pop(function, ()))
        if function in self._ring:
            self._ring.remove(function)
        if function in self._arrivals:
            self._arrivals.remove(function)
        return dropped

    def queued_blocks(self, function: Hashable | None = None) -> int:
        if function is not None:
            return len(self._queues.get(function, ()))
        return sum(len(q) for q in self._queues.values())

    def __bool__(self) -> bool:
        return bool(self._queues)
