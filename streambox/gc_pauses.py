"""Garbage-collector pauses in StreamBox's long-lived processes, and keeping them short.

Python's cyclic collector stops every thread of its process (it runs with the GIL held), and a full
collection (generation 2) walks every container object the process tracks. A proxy or the replay
driver imports torch and the project: ~350,000 tracked objects, whose full collection takes 160-300
ms on this project's 2-core host (measured: docs/api_proxy.md, "Garbage-collector pauses"), longer
than the paper's 200 ms SLO, and the interpreter starts one by itself whenever enough objects
survive. Almost all of those objects are the process's imports and setup, alive until it exits.

`freeze_startup_heap` moves them to the permanent generation (`gc.freeze`, made for this: CPython's
documentation suggests it for processes that set up once and then serve), which collections never
walk: a full collection afterwards walks only what the process made since, milliseconds. Cyclic
garbage made before the freeze is kept for good, so the freeze comes after a collection of the young
generations (or a full one, where no request waits). `frozen_heap` freezes for a while only: the
replay driver, whose pauses would delay the requests it sends and the replies it times, for the span
of one replay.

`GcPauses` counts collections and how long they stopped the process (a `gc.callbacks` hook), for
the proxy's `stats` and the replay's summary. `STREAMBOX_FREEZE_HEAP=0` in the environment switches
the freezing off in every process (`freezing`): the measurement without it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Iterator
from typing import Any

from pydantic import TypeAdapter, ValidationError

from .settings_base import ENV_PREFIX

GENERATIONS = 3


class GcPauses:
    """Collections per generation of this process and the seconds they stopped it, since `install`."""

    def __init__(self) -> None:
        self.collections = [0] * GENERATIONS
        self.pause_s = [0.0] * GENERATIONS
        self.max_pause_s = 0.0
        self._started: float | None = None  # the collection in progress began (None: none seen)

    def install(self) -> None:
        """Start counting (idempotent)."""
        if self._on_gc not in gc.callbacks:
            gc.callbacks.append(self._on_gc)

    def uninstall(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
            return
        started, self._started = self._started, None
        if started is None:  # installed during a collection: its start was not seen
            return
        generation, pause = info["generation"], now - started
        self.collections[generation] += 1
        self.pause_s[generation] += pause
        if pause > self.max_pause_s:
            self.max_pause_s = pause

    def counters(self) -> dict[str, float]:
        """Counters for a stats reply: all collections and full ones, their total pause in seconds,
        the longest pause, and the objects frozen out of every collection."""
        return {
            "gc_collections": float(sum(self.collections)),
            "gc_full_collections": float(self.collections[-1]),
            "gc_pause_s": sum(self.pause_s),
            "gc_full_pause_s": self.pause_s[-1],
            "gc_max_pause_s": self.max_pause_s,
            "gc_frozen_objects": float(_frozen[0]),
        }


#: This process's counter (a process has one collector).
PAUSES = GcPauses()
#: Objects frozen by `freeze_startup_heap`, counted once: `gc.get_freeze_count` walks the frozen list
#: (35 ms for a proxy's 350,000 objects), too slow for every stats reply (it cost a proxy's dispatcher
#: half again its CPU time at four replies a second).
_frozen = [0]


def freezing() -> bool:
    """Whether this process's heap is to be frozen (`STREAMBOX_FREEZE_HEAP`, default on)."""
    name = f"{ENV_PREFIX}FREEZE_HEAP"
    value = os.environ.get(name)
    if value is None:
        return True
    try:
        return TypeAdapter(bool).validate_python(value)
    except ValidationError:
        raise ValueError(f"{name}={value!r}: expected a boolean (1/0, true/false, on/off)") from None


def freeze_startup_heap(full: bool = False) -> int:
    """Move every object this process tracks now to the permanent generation, after collecting the
    young generations (`full`: every generation; ~0.2 s with torch imported, for where no request
    waits). Returns the number of frozen objects."""
    gc.collect(GENERATIONS - 1 if full else 1)
    gc.freeze()
    _frozen[0] = gc.get_freeze_count()
    return _frozen[0]


@contextlib.contextmanager
def frozen_heap() -> Iterator[GcPauses]:
    """Within the block, what the process holds at its start is out of every collection (a full
    collection first: call it where nothing waits; unless `freezing()` is off); after it, back in the
    oldest generation. Yields a `GcPauses` counting the block's collections."""
    pauses = GcPauses()
    frozen = freezing()
    if frozen:
        freeze_startup_heap(full=True)
    pauses.install()
    try:
        yield pauses
    finally:
        pauses.uninstall()
        if frozen:
            gc.unfreeze()
            _frozen[0] = 0
