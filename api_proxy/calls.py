"""Running forwarded calls: each call is a process (a generator op) that runs until it yields what it
waits for, is parked, and is resumed where it stopped when that arrives -- never run again from the
start.

- `Offload` (slow work on a helper thread): the instance is *held* (its later messages queue, in
  order) until the future is done; then the call goes on and the held messages are handled.
- `Completion` (device work before an event): polled by the dispatcher between messages (sync-lite,
  `completion="poll"`), or waited for by a helper thread that posts back (`completion="sync"`).
- `KeyPut` (a GET whose key is not there yet): the store calls back on the key's PUT
  (`Store.watch`); a deadline here fails the GET if none comes.

A call whose instance died or whose invocation ended while it was parked is closed (its `finally`
blocks run) instead of resumed. All of it runs on the dispatcher thread; helper threads only `post`.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import GeneratorType
from typing import Any

from streambox.comm.store_protocol import Store
from streambox.device import Event
from streambox.phases import COMM, DEVICE_WAIT, OTHER

from .errors import ProxyError, encode_error
from .state import Instance, Invocation
from .waits import Completion, KeyPut, Offload, Wait

Reply = Callable[[Instance, int, bool, Any], None]
Then = Callable[[BaseException | None], None]


@dataclass(eq=False)
class Process:
    inst: Instance
    inv: Invocation
    call_id: int
    gen: Generator[Wait, Any, Any]
    phase: str = OTHER  # what its op's own time counts as (`phases.op_phase`)
    parked: tuple[str, float] | None = None  # the phase of what it waits for, since when

    @property
    def alive(self) -> bool:
        return self.inst.state != "dead" and self.inst.invocation is self.inv


def _wait_phase(proc: Process, wait: Wait) -> str:
    """An offload counts as what it says (else as its op), device completion as compute, a GET's wait
    for its key's PUT as communication."""
    if isinstance(wait, Offload):
        return wait.phase or proc.phase
    return DEVICE_WAIT if isinstance(wait, Completion) else COMM


@dataclass(order=True)
class _KeyWait:
    deadline: float
    seq: int
    proc: Process = field(compare=False)
    wait: KeyPut = field(compare=False)
    cancel: Callable[[], None] | None = field(default=None, compare=False)
    done: bool = field(default=False, compare=False)


class Calls:
    """Parks and resumes the calls of every instance (see the module doc)."""

    def __init__(
        self,
        store: Store,
        reply: Reply,
        wake: Callable[[], None],
        handle_held: Callable[[Instance, Any], None],
        *,
        sync_completion: bool,
    ) -> None:
        self._store, self._reply, self._wake, self._handle_held = store, reply, wake, handle_held
        self.polls: list[tuple[Instance, Event, Then]] = []
        self.posted: deque[Callable[[], None]] = deque()
        self._keys: list[_KeyWait] = []  # a heap by deadline
        self._seq = itertools.count()
        self._sync_pool = (
            ThreadPoolExecutor(max_workers=32, thread_name_prefix="streambox-sync")
            if sync_completion
            else None
        )

    def close(self) -> None:
        if self._sync_pool is not None:
            self._sync_pool.shutdown(wait=True, cancel_futures=True)

    # -- starting and resuming ---------------------------------------------------------------
    def run(self, inst: Instance, inv: Invocation, call_id: int, result: Any, phase: str = OTHER) -> None:
        """Answer a call whose op returned `result`: a value replies at once, a generator runs (its
        steps and waits timed into the invocation's phases)."""
        if isinstance(result, GeneratorType):
            self._step(Process(inst, inv, call_id, result, phase))
        else:
            self._reply(inst, call_id, True, result)

    def _step(self, proc: Process, value: Any = None, error: BaseException | None = None) -> None:
        started = time.perf_counter()
        try:
            wait = proc.gen.send(value) if error is None else proc.gen.throw(error)
        except StopIteration as stop:
            proc.inv.phases.add(proc.phase, started, time.perf_counter())
            self._reply(proc.inst, proc.call_id, True, stop.value)
        except Exception as exc:  # noqa: BLE001 - a failed call fails only that call
            proc.inv.phases.add(proc.phase, started, time.perf_counter())
            self._reply(proc.inst, proc.call_id, False, encode_error(exc))
        else:
            now = time.perf_counter()
            proc.inv.phases.add(proc.phase, started, now)
            self._park(proc, wait, now)

    def _park(self, proc: Process, wait: Wait, now: float) -> None:
        proc.parked = (_wait_phase(proc, wait), now)
        if isinstance(wait, Offload):
            proc.inst.held = deque()
            wait.future.add_done_callback(lambda _: self.post(lambda: self._offloaded(proc, wait)))
        elif isinstance(wait, Completion):
            self.complete(proc.inst, wait.event, lambda error: self._resume(proc, None, error))
        elif isinstance(wait, KeyPut):
            entry = _KeyWait(wait.deadline, next(self._seq), proc, wait)
            heapq.heappush(self._keys, entry)
            entry.cancel = self._store.watch(wait.key, lambda: self.post(lambda: self._key_put(entry)))
        else:
            proc.gen.close()
            self._reply(proc.inst, proc.call_id, False, encode_error(ProxyError(f"an op yielded {wait!r}")))

    def _resume(self, proc: Process, value: Any, error: BaseException | None) -> None:
        if proc.parked is not None:
            (phase, since), proc.parked = proc.parked, None
            proc.inv.phases.add(phase, since, time.perf_counter())
        if proc.alive:
            self._step(proc, value, error)
        else:
            proc.gen.close()  # its request was failed already

    def _offloaded(self, proc: Process, wait: Offload) -> None:
        inst = proc.inst
        held, inst.held = inst.held, None
        error = wait.future.exception()
        if error is None:
            self._resume(proc, wait.future.result(), None)
        else:
            why = ProxyError(f"{wait.what} failed: {type(error).__name__}: {error}")
            self._resume(proc, None, why)
        while held and inst.state != "dead":
            if inst.held is not None:  # a call held again: the rest waits behind it
                inst.held.extend(held)
                return
            self._handle_held(inst, held.popleft())

    def _key_put(self, entry: _KeyWait) -> None:
        if not entry.done:
            entry.done = True
            self._resume(entry.proc, None, None)

    def expire_keys(self, now: float) -> int:
        """Fail the GETs whose deadline passed without a PUT; drop the entries already settled."""
        n = 0
        while self._keys and (self._keys[0].done or now >= self._keys[0].deadline):
            entry = heapq.heappop(self._keys)
            if entry.cancel is not None:
                entry.cancel()
            if not entry.done:
                entry.done = True
                self._resume(entry.proc, None, entry.wait.expired)
                n += 1
        return n

    def next_key_deadline(self) -> float | None:
        live = [e.deadline for e in self._keys if not e.done]
        return min(live) if live else None

    # -- device completion -------------------------------------------------------------------
    def complete(self, inst: Instance, event: Event, then: Then) -> None:
        """Call `then(error)` on the dispatcher once `event` (the tail of the instance's stream) is done."""
        if self._sync_pool is None:
            self.polls.append((inst, event, then))
            return

        def wait() -> None:
            error: BaseException | None = None
            try:
                inst.stream.synchronize()
            except BaseException as exc:  # noqa: BLE001 - handed to the dispatcher
                error = exc
            self.post(lambda: then(error))

        self._sync_pool.submit(wait)

    def pending(self) -> bool:
        """Whether a posted callback or a completed device event waits for the dispatcher (only looks:
        an issuer thread asks it at its slice boundaries)."""
        return bool(self.posted) or any(event.query() for _, event, _ in list(self.polls))

    def poll_completions(self) -> int:
        done, waiting = [], []
        for p in self.polls:
            (done if p[1].query() else waiting).append(p)
        if not done:
            return 0
        self.polls[:] = waiting  # the same list: callbacks below may add to it
        for _, event, then in done:
            error: BaseException | None = None
            try:
                event.synchronize()  # complete already: returns at once, raising the stream's errors
            except BaseException as exc:  # noqa: BLE001 - reported to the call that waited
                error = exc
            then(error)
        return len(done)

    # -- the dispatcher's inbox --------------------------------------------------------------
    def post(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the dispatcher (from any thread)."""
        self.posted.append(fn)
        self._wake()

    def run_posted(self) -> int:
        n = 0
        while self.posted:
            self.posted.popleft()()
            n += 1
        return n

    def drop(self, inst: Instance) -> None:
        """Forget the completions an instance waits for (it is gone); its parked GETs are closed when
        their deadline or key comes (`Process.alive` is false by then)."""
        self.polls[:] = [p for p in self.polls if p[0] is not inst]
        for entry in self._keys:
            if entry.proc.inst is inst and not entry.done:
                entry.done = True
                entry.proc.gen.close()
