"""The IO daemon (paper section 7): the thin shell that moves the functions' host-to-device copies.

Functions hand their copy requests to `IODaemon.submit` and get a `Ticket`. The daemon thread cuts
nothing and decides nothing itself: `blocks.split_into_blocks` cuts a submission into blocks with
sync flags, `scheduler.BlockScheduler` decides which blocks form the next batch. The thread then, per
batch boundary:

1. retires what must be complete (at most `inflight_batches` batches stay in flight), so requests that
   arrived meanwhile join the next batch (preemption happens in the scheduler's `next_batch`);
2. per block: stages its pieces into the next slot of the shared pinned ring (PB on; PB off: a pinned
   buffer allocated per request), issues `copy_htod_async` on the daemon's copy stream (one call per
   run of pieces whose destinations are adjacent), and records an event;
3. for a block that completes layers, hands that event to the function's ticket: the function makes its
   compute stream wait on it (`Ticket.wait`) before the layer's kernel. Pipelined loading.

A ring slot is staged again only after the block that used it has been retired (its event completed),
so no copy ever reads a slot that is being overwritten. Errors of a copy (e.g. its destination was freed)
are found when its block is retired, fail that function's ticket and drop its queued blocks; the other
functions go on.

In `stream-only` mode there is no thread: `submit` issues one copy per request straight to the copy
engine, in issue order, on a copy stream of the function, with the same per-layer events.

Device-to-host copies do not go through the daemon: they use the device-to-host engine, which host-to-
device loading does not contend for; a result is needed on the function's own stream right after the
kernel that produced it (through the daemon it would need a cross-stream wait and a staging memcpy);
and results are small (same-GPU hand-overs never leave the device).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from streambox.device import DeviceError, Event, HostBuffer, Runtime, Stream

from .blocks import Block, Layer, coalesce, layer_ends, split_into_blocks
from .config import DaemonConfig
from .scheduler import BlockScheduler
from .staging import TransferRing, host_bytes

_daemon_ids = itertools.count(1)


@dataclass(frozen=True)
class CopyRequest:
    """Copy `nbytes` from host `src` (at `src_offset`) to device address `dst`; part of `layer`.

    The source must stay unchanged until the ticket completes: the daemon stages it when its block
    comes up, not at submit."""

    dst: int
    src: torch.Tensor | HostBuffer
    nbytes: int
    layer: Layer = None
    src_offset: int = 0


class Ticket:
    """A function's handle on one submission: per-layer events and completion."""

    def __init__(
        self, function: Hashable, layers: Iterable[Layer], empty_layers: Iterable[Layer], blocks: int
    ):
        self.function = function
        self.blocks = blocks
        self._cond = threading.Condition()
        self._layers = set(layers)
        self._events: dict[Layer, Event | None] = dict.fromkeys(empty_layers)
        self._to_issue = blocks
        self._to_retire = blocks
        self._last: Event | None = None
        self._sync_event: Event | None = None  # stream-only: completion is this event's
        self._error: BaseException | None = None
        self._settled = blocks == 0  # no block of it queued or in flight any more (daemon thread)

    def __repr__(self) -> str:
        return f"<Ticket {self.function!r} {self.blocks} blocks, {self._to_retire} outstanding>"

    # -- the daemon's side ----------------------------------------------------------------------
    def _layers_ready(self, layers: Iterable[Layer], event: Event) -> None:
        with self._cond:
            for layer in layers:
                self._events[layer] = event
            self._cond.notify_all()

    def _issued(self, event: Event) -> None:
        with self._cond:
            self._to_issue -= 1
            self._last = event
            self._cond.notify_all()

    def _retired(self) -> None:
        with self._cond:
            self._to_retire -= 1
            self._cond.notify_all()

    def _direct(self, done: Event) -> None:
        with self._cond:
            self._to_issue = self._to_retire = 0
            self._last = self._sync_event = done
            self._cond.notify_all()

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = error
            self._cond.notify_all()

    # -- the function's side --------------------------------------------------------------------
    @property
    def error(self) -> BaseException | None:
        return self._error

    def _wait(self, ready: Callable[[], bool], timeout: float | None, what: str) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: ready() or self._error is not None, timeout):
                raise TimeoutError(f"function {self.function!r}: {what} not ready after {timeout} s")
            if self._error is not None:
                raise self._error

    def event_for(self, layer: Layer, timeout: float | None = None) -> Event | None:
        """The event that completes when `layer`'s bytes are on the device (None: the layer has no
        bytes). Blocks until the daemon has *issued* the layer's last block, not until it arrived."""
        if layer not in self._layers:
            raise KeyError(f"layer {layer!r} is not in this submission of {self.function!r}")
        self._wait(lambda: layer in self._events, timeout, f"layer {layer!r}")
        return self._events[layer]

    def wait(self, layer: Layer, stream: Stream, timeout: float | None = None) -> None:
        """Make later work on `stream` wait until `layer` has arrived (stream-waits-on-event)."""
        event = self.event_for(layer, timeout)
        if event is not None:
            stream.wait_event(event)

    def wait_all(self, stream: Stream, timeout: float | None = None) -> None:
        """Make later work on `stream` wait until every byte of the submission has arrived."""
        self._wait(lambda: self._to_issue == 0, timeout, "the last block")
        if self._last is not None:
            stream.wait_event(self._last)

    def last_event(self, timeout: float | None = None) -> Event | None:
        """The event of the submission's last block (None if it had no bytes)."""
        self._wait(lambda: self._to_issue == 0, timeout, "the last block")
        return self._last

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until every byte has arrived; raises the copy error that failed the submission."""
        self._wait(lambda: self._to_retire == 0, timeout, "completion")
        if self._sync_event is not None:
            self._sync_event.synchronize()

    def query(self) -> bool:
        if self._sync_event is not None:
            return self._sync_event.query()
        return self._to_retire == 0 or self._error is not None

    @property
    def issued(self) -> bool:
        """Every block has been issued (waiting for the last event would not block the host)."""
        with self._cond:
            return self._to_issue == 0

    @property
    def settled(self) -> bool:
        """No copy of this submission is queued or in flight any more (completed, failed or dropped):
        its destinations may be freed."""
        if self._sync_event is not None:
            return self._sync_event.query()
        with self._cond:
            return self._settled


@dataclass
class DaemonStats:
    submissions: int = 0
    requests: int = 0
    nbytes: int = 0
    blocks: int = 0
    batches: int = 0
    copy_calls: int = 0
    pinned_allocations: int = 0
    pinned_bytes: int = 0
    failed_blocks: int = 0


@dataclass(frozen=True)
class IssuedBlock:
    """What the daemon issued, for tests and benchmarks (`IODaemon.trace`)."""

    function: Hashable
    submission: int
    seq: int
    nbytes: int
    batch: int
    calls: int
    flags: tuple[Layer, ...]
    event: Event


@dataclass(eq=False)
class _Submission:
    id: int
    function: Hashable
    requests: list[CopyRequest]
    hosts: list[np.ndarray]
    ticket: Ticket
    outstanding: int
    staging: dict[int, HostBuffer] = field(default_factory=dict)  # PB off: per-request pinned buffers


@dataclass(eq=False)
class _InFlight:
    block: Block
    event: Event
    batch: int
    sub: _Submission
    slot: int | None


class IODaemon:
    """Host-to-device copies of every function of one runtime. See the module doc."""

    def __init__(self, runtime: Runtime, config: DaemonConfig | None = None, *, trace_limit: int = 1 << 20):
        self.runtime = runtime
        self.config = config = config or DaemonConfig()
        self.stats = DaemonStats()
        self.trace: deque[IssuedBlock] = deque(maxlen=trace_limit)
        self.name = f"streambox-io-daemon-{next(_daemon_ids)}"
        self._cond = threading.Condition()
        self._closing = False
        self._closed = False
        self._subs: dict[int, _Submission] = {}
        self._sub_ids = itertools.count()
        self._next_seq: dict[Hashable, int] = {}
        self._function_streams: dict[Hashable, Stream] = {}
        self._scheduler = BlockScheduler(config.batch_blocks)
        self._inflight: deque[_InFlight] = deque()
        self._batch_no = 0
        self._ring: TransferRing | None = None
        self._thread: threading.Thread | None = None
        self._idle = False  # the daemon thread waits for work, with nothing queued or in flight
        self.stream: Stream | None = None
        if config.mode == "streambox":
            self.stream = runtime.create_stream()
            if config.pinned_buffer:
                self._ring = TransferRing(runtime, config.slots, config.block_size)
                self.stats.pinned_allocations += 1
                self.stats.pinned_bytes += config.ring_bytes
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    def __repr__(self) -> str:
        return f"<IODaemon {self.name} {self.config.label}>"

    # -- the functions' API ---------------------------------------------------------------------
    def submit(
        self, function: Hashable, requests: Iterable[CopyRequest], *, stream: Stream | None = None
    ) -> Ticket:
        """Queue `requests` of `function` (in this order); returns at once with a ticket.

        `stream` matters in stream-only mode only: the copies go on it (default: a copy stream of the
        function's own)."""
        requests = list(requests)
        hosts = []
        for i, r in enumerate(requests):
            what = f"request {i} of {function!r}"
            host = host_bytes(r.src, what)
            if r.nbytes < 0 or r.src_offset < 0 or r.src_offset + r.nbytes > host.size:
                raise ValueError(
                    f"{what}: source range [{r.src_offset}, {r.src_offset + r.nbytes}) "
                    f"does not fit its {host.size} bytes"
                )
            hosts.append(host)
        sizes = [r.nbytes for r in requests]
        layers = [r.layer for r in requests]
        if self.config.mode == "stream-only":
            return self._submit_direct(function, requests, sizes, layers, stream)
        with self._cond:
            if self._closing:
                raise DeviceError(f"{self.name} is closed")
            sub_id = next(self._sub_ids)
            first = self._next_seq.get(function, 0)
            split = split_into_blocks(
                sizes, layers, self.config.block_size, function=function, submission=sub_id, first_seq=first
            )
            self._next_seq[function] = first + len(split.blocks)
            ticket = Ticket(function, layers, split.empty_layers, len(split.blocks))
            self._count(requests)
            if split.blocks:
                self._subs[sub_id] = _Submission(sub_id, function, requests, hosts, ticket, len(split.blocks))
                self._scheduler.submit(function, split.blocks)
                if self._idle and not self._inflight and len(split.blocks) <= self.config.batch_blocks:
                    # The idle daemon's next batch would be exactly these blocks: issue it here, and
                    # save the caller two thread hand-offs (about a millisecond on a busy host).
                    self._issue_batch(self._scheduler.next_batch())
                self._cond.notify_all()  # the daemon issues the rest, or retires what was issued here
        return ticket

    def copy_stream(self, function: Hashable, stream: Stream | None = None) -> Stream:
        """The stream `submit(function, ..., stream=stream)` issues its copies on: the daemon's own in
        streambox mode, `stream` (or the function's copy stream) in stream-only mode. Allocate a
        destination for that stream: a block another stream freed may still be read or written by
        that stream's queued kernels, and only work ordered after them may reuse it."""
        if self.config.mode == "stream-only":
            return stream or self.function_stream(function)
        assert self.stream is not None  # made with the daemon in streambox mode
        return self.stream

    def function_stream(self, function: Hashable) -> Stream:
        """Stream-only mode: the copy stream of `function` (created on first use)."""
        with self._cond:
            if function not in self._function_streams:
                self._function_streams[function] = self.runtime.create_stream()
            return self._function_streams[function]

    @property
    def batches_formed(self) -> int:
        """Batches taken from the scheduler so far (a request submitted now can join batch number
        `batches_formed` at the earliest)."""
        with self._cond:
            return self._scheduler.batches

    def cancel(self, function: Hashable, error: BaseException | None = None) -> None:
        """Drop `function`'s queued blocks; its open tickets fail with `error` (blocks in flight finish).
        In stream-only mode every copy is already on the engine's queue: nothing to drop."""
        self._fail(function, error or DeviceError(f"transfers of {function!r} were cancelled"))

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until every submission so far has arrived (or failed)."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._subs, timeout):
                raise TimeoutError(f"{self.name}: {len(self._subs)} submissions still open after {timeout} s")
        for s in list(self._function_streams.values()):
            s.synchronize()

    def close(self) -> None:
        """Finish everything queued, then stop the thread and give the ring back."""
        with self._cond:
            if self._closed:
                return
            self._closing = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        if self._ring is not None:
            self._ring.free()
        for s in [self.stream, *self._function_streams.values()]:
            if s is not None:
                with contextlib.suppress(DeviceError):  # a copy error belongs to its ticket, not to close
                    s.synchronize()
                s.destroy()
        self._closed = True

    def __enter__(self) -> IODaemon:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- stream-only: straight to the copy engine -----------------------------------------------
    def _submit_direct(
        self,
        function: Hashable,
        requests: list[CopyRequest],
        sizes: list[int],
        layers: list[Layer],
        stream: Stream | None,
    ) -> Ticket:
        stream = stream or self.function_stream(function)
        closing, empty = layer_ends(sizes, layers)
        ticket = Ticket(function, layers, empty, sum(n > 0 for n in sizes))
        for i, r in enumerate(requests):
            if r.nbytes == 0:
                continue
            self.runtime.copy_htod_async(r.dst, r.src, r.nbytes, stream, src_offset=r.src_offset)
            self.stats.copy_calls += 1
            if i in closing:
                event = self.runtime.create_event()
                event.record(stream)
                ticket._layers_ready(closing[i], event)
        done = self.runtime.create_event()
        done.record(stream)
        ticket._direct(done)
        with self._cond:
            self._count(requests)
        return ticket

    def _count(self, requests: list[CopyRequest]) -> None:
        self.stats.submissions += 1
        self.stats.requests += len(requests)
        self.stats.nbytes += sum(r.nbytes for r in requests)

    # -- the daemon thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not self._scheduler and not self._inflight and not self._closing:
                        self._idle = True  # only now may `submit` issue a batch on its own thread
                        self._cond.wait()
                        self._idle = False
                    work = bool(self._scheduler)
                    if not work and not self._inflight:
                        return  # closing and drained
                if not work:
                    self._retire_one()  # idle: finish in-flight blocks one by one, stay responsive
                    continue
                # Batch boundary: at most `inflight_batches` batches stay in flight.
                batch_no = self._batch_no
                while self._inflight and self._inflight[0].batch <= batch_no - self.config.inflight_batches:
                    self._retire_one()
                with self._cond:
                    batch = self._scheduler.next_batch()  # newcomers preempt here
                self._issue_batch(batch)
        except BaseException as exc:  # a bug or a dead device: fail every open ticket, never hang one
            with self._cond:
                self._closing = True
                subs = list(self._subs.values())
                self._subs.clear()
                self._cond.notify_all()
            for sub in subs:
                sub.ticket._fail(exc)
            raise

    def _issue_batch(self, batch: list[Block]) -> None:
        """Issue one batch: on the daemon thread, or on an idle daemon's submitter under `_cond`."""
        if not batch:
            return
        batch_no = self._batch_no
        self._batch_no += 1
        self.stats.batches += 1
        for block in batch:
            self._issue(block, batch_no)

    def _issue(self, block: Block, batch_no: int) -> None:
        sub = self._subs.get(block.submission)
        if sub is None:
            return
        if sub.ticket.error is not None:  # its function failed while this batch was being issued
            self._settle(sub, 1)
            return
        slot = None
        if self._ring is not None:
            slot = self._ring.next_slot()
            while self._ring.owner[slot] is not None:  # the slot's previous copy must have completed
                self._retire_one()
        try:
            calls = self._copy(sub, block, slot)
        except (DeviceError, ValueError) as exc:  # e.g. the destination was freed before its turn
            calls = 0
            self.stats.failed_blocks += 1
            self._fail(sub.function, exc)
        event = self.runtime.create_event()
        event.record(self.stream)  # type: ignore[arg-type]
        entry = _InFlight(block, event, batch_no, sub, slot)
        self._inflight.append(entry)  # retired like any other: a slot may still be read by a copy
        if self._ring is not None and slot is not None:
            self._ring.owner[slot] = entry
        if block.flags:
            sub.ticket._layers_ready(block.flags, event)
        sub.ticket._issued(event)
        self.stats.blocks += 1
        self.stats.copy_calls += calls
        self.trace.append(
            IssuedBlock(
                block.function, block.submission, block.seq, block.nbytes, batch_no, calls, block.flags, event
            )
        )

    def _copy(self, sub: _Submission, block: Block, slot: int | None) -> int:
        """Stage `block` and issue its copies on the daemon's stream; returns the number of calls."""
        rt, stream = self.runtime, self.stream
        assert stream is not None
        if self._ring is None or slot is None:
            for p in block.pieces:
                r = sub.requests[p.request]
                staging = self._staging(sub, p.request)
                rt.copy_htod_async(r.dst + p.offset, staging, p.nbytes, stream, src_offset=p.offset)
            return len(block.pieces)
        extents = []
        position = self._ring.offset(slot)
        for p in block.pieces:
            r = sub.requests[p.request]
            start = r.src_offset + p.offset
            np.copyto(
                self._ring.bytes[position : position + p.nbytes],
                sub.hosts[p.request][start : start + p.nbytes],
            )
            extents.append((r.dst + p.offset, position, p.nbytes))
            position += p.nbytes
        runs = coalesce(extents)
        for dst, src, n in runs:
            rt.copy_htod_async(dst, self._ring.buffer, n, stream, src_offset=src)
        return len(runs)

    def _staging(self, sub: _Submission, index: int) -> HostBuffer:
        """PB off: the request's own pinned buffer, allocated (and filled) when its first block comes up."""
        buffer = sub.staging.get(index)
        if buffer is None:
            r = sub.requests[index]
            buffer = self.runtime.host_alloc(max(r.nbytes, 1), pinned=True)
            np.copyto(
                host_bytes(buffer)[: r.nbytes], sub.hosts[index][r.src_offset : r.src_offset + r.nbytes]
            )
            sub.staging[index] = buffer
            self.stats.pinned_allocations += 1
            self.stats.pinned_bytes += r.nbytes
        return buffer

    def _retire_one(self) -> None:
        """Wait for the oldest in-flight block; free its slot and finished staging; settle errors."""
        entry = self._inflight.popleft()
        sub = entry.sub
        try:
            entry.event.synchronize()
        except DeviceError as exc:
            self.stats.failed_blocks += 1
            self._fail(sub.function, exc)
        if entry.slot is not None and self._ring is not None:
            self._ring.owner[entry.slot] = None
        for p in entry.block.pieces:
            if p.offset + p.nbytes == sub.requests[p.request].nbytes and p.request in sub.staging:
                sub.staging.pop(p.request).free()
        sub.ticket._retired()
        self._settle(sub, 1)

    def _settle(self, sub: _Submission, blocks: int) -> None:
        with self._cond:
            sub.outstanding -= blocks
            if sub.outstanding == 0:
                self._subs.pop(sub.id, None)
                sub.ticket._settled = True
                for buffer in sub.staging.values():
                    buffer.free()
                sub.staging.clear()
                self._cond.notify_all()

    def _fail(self, function: Hashable, error: BaseException) -> None:
        with self._cond:
            dropped = self._scheduler.cancel(function)
            subs = [s for s in self._subs.values() if s.function == function]
            dropped_subs = [self._subs.get(block.submission) for block in dropped]
        for sub in subs:
            sub.ticket._fail(error)
        for dropped_sub in dropped_subs:
            if dropped_sub is not None:
                self._settle(dropped_sub, 1)
