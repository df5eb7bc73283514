"""What a forwarded op may wait for. An op is a generator: it *yields* one of these and is resumed
where it stopped with the outcome (`send`), or with the failure raised at the `yield` (`throw`); it is
never run again from the start. `calls.Calls` parks and resumes them (SimPy processes are the model).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from streambox.device import Event


@dataclass(frozen=True, slots=True)
class Offload:
    """Slow work on a helper thread (a plan lowered, weights issued, uploads issued). The instance is
    *held* meanwhile: its later messages queue in order, so its stream sees its work in program order.
    Resumed with the future's result; its error is raised as `ProxyError("<what> failed: ...")`.
    `phase` says what the wait counts as in the request's phase timings (`phases.py`; None: as the op)."""

    future: Future[Any]
    what: str
    phase: str | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    """The device work before `event` (recorded on the instance's stream): resumed with None once it
    is done, or with the stream's error raised. The instance's later calls go on meanwhile."""

    event: Event


@dataclass(frozen=True, slots=True)
class KeyPut:
    """A PUT of `key` (the store's notification): resumed with None after the next PUT of the key,
    or with `expired` raised at `deadline` (the dispatcher's clock)."""

    key: str
    deadline: float
    expired: BaseException


Wait = Offload | Completion | KeyPut
