"""Cross-process accounting: every process that opens an emulated GPU shares its capacity."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from streambox.device.base import OutOfDeviceMemory
from streambox.device.emulated import EmulatedBackend
from streambox.device.ledger import Ledger, ledger_path, process_alive
from streambox.device.specs import MiB

from .conftest import SMALL_SPEC

# A child that drives one emulated GPU from stdin commands and acknowledges each on stdout.
_CHILD = textwrap.dedent(
    """
    import os, sys
    from streambox.device.emulated import EmulatedBackend
    from streambox.device.specs import V100_16GB, MiB
    spec = V100_16GB.with_overrides(
        name={name!r}, total_memory={total}, compute_units=8, context_create_s=0.0,
        context_memory={context},
    )
    backend = EmulatedBackend(spec, state_dir=sys.argv[1])
    runtime = None
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "open":
            runtime = backend.open_runtime(0)
            runtime.create_stream()
        elif cmd == "alloc":
            runtime.mem_alloc(int(args[0]))
        elif cmd == "close":
            runtime.close()
        elif cmd == "exit":
            sys.exit(0)  # atexit gives the slot back
        elif cmd == "_exit":
            os._exit(0)
        print("ok", flush=True)
    """
)


class Child:
    def __init__(self, state_dir, context=MiB):
        script = _CHILD.format(name=SMALL_SPEC.name, total=SMALL_SPEC.total_memory, context=context)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", script, str(state_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd="/",  # never the repository root: its `streambox/` folder would shadow the package
        )

    def do(self, command: str) -> None:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "ok", f"child failed on {command!r}"

    def send(self, command: str) -> None:
        assert self.proc.stdin
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()


def _usage(backend):
    u = backend.device_usage()[0]
    return u.used_memory, u.streams, u.runtimes


def test_usage_is_shared_across_processes(tmp_path):
    state = tmp_path / "state"
    backend = EmulatedBackend(SMALL_SPEC, state_dir=state)
    child = Child(state)
    try:
        child.do("open")
        child.do(f"alloc {32 * MiB}")
        assert _usage(backend) == (33 * MiB, 1, 1)  # 1 MiB context + 32 MiB
        mine = backend.open_runtime(0)
        assert mine.memory_info() == (31 * MiB, 64 * MiB)
        with pytest.raises(OutOfDeviceMemory) as info:
            mine.mem_alloc(40 * MiB)
        assert info.value.free == 31 * MiB
        mine.mem_alloc(16 * MiB)
        assert _usage(backend) == (49 * MiB, 1, 2)
        child.do("close")  # release on close, the process still alive
        assert _usage(backend) == (16 * MiB, 0, 1)
        child.do("open")
        child.do(f"alloc {8 * MiB}")
        assert _usage(backend) == (25 * MiB, 1, 2)
        child.send("exit")  # interpreter exit with the runtime open: atexit releases it
        child.proc.wait(30)
        assert _usage(backend) == (16 * MiB, 0, 1)
        mine.close()
        assert _usage(backend) == (0, 0, 0)
    finally:
        child.proc.kill()
        child.proc.wait()
        backend.close()


def _hold_memory(state_dir, nbytes, ready, how):  # runs in a forked child
    runtime = EmulatedBackend(SMALL_SPEC, state_dir=state_dir).open_runtime(0)
    runtime.create_stream()
    runtime.create_stream()
    runtime.mem_alloc(nbytes)
    ready.set()
    if how == "_exit":
        os._exit(0)  # no atexit, no close
    time.sleep(60)  # until SIGKILL


@pytest.mark.parametrize("how", ["_exit", "kill"])
def test_dead_process_usage_is_reclaimed(tmp_path, how):
    """A process that dies without releasing (os._exit, SIGKILL) leaves nothing behind.

    The children are forked (starting a Python that imports torch costs seconds): they open their own
    runtime (the parent's ledger state is not inherited, see `ledger._after_fork_in_child`).
    """
    backend = EmulatedBackend(SMALL_SPEC, state_dir=tmp_path)
    mine = backend.open_runtime(0)
    mine.mem_alloc(4 * MiB)
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=_hold_memory, args=(tmp_path, 50 * MiB, ready, how))
    child.start()
    try:
        assert ready.wait(20)
        if how == "kill":
            assert _usage(backend) == (54 * MiB, 2, 2)
            with pytest.raises(OutOfDeviceMemory) as info:
                mine.mem_alloc(20 * MiB)
            assert info.value.free == 10 * MiB
            os.kill(child.pid, signal.SIGKILL)
        # no join(): even an unreaped (zombie) child counts as dead
        deadline = time.monotonic() + 20
        while _usage(backend) != (4 * MiB, 0, 1) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _usage(backend) == (4 * MiB, 0, 1)
        mine.mem_alloc(60 * MiB)
    finally:
        child.kill()
        child.join()
        mine.close()
        backend.close()
    assert _usage(backend) == (0, 0, 0)


def test_ledger_slots_and_liveness(tmp_path):
    assert process_alive(os.getpid())
    assert not process_alive(0)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert not process_alive(dead.pid)
    path = ledger_path(tmp_path, 0, "x", 1000)
    assert path != ledger_path(tmp_path, 0, "x", 2000) != ledger_path(tmp_path, 1, "x", 1000)
    ledger = Ledger.open(path, 1000)
    assert Ledger.open(path, 1000) is ledger
    slot = ledger.acquire_slot(runtime_id=987654, initial_bytes=100)
    ledger.reserve(slot, 987654, 800)
    with pytest.raises(OutOfDeviceMemory) as info:
        ledger.reserve(slot, 987654, 200)
    assert (info.value.requested, info.value.free) == (200, 100)
    ledger.add_streams(slot, 987654, 3)
    assert ledger.slot_usage(slot, 987654) == (900, 3)
    ledger.release(slot, 987654, 900)
    ledger.release_slot(slot, 987654)
    ledger.release_slot(slot, 987654)  # idempotent
    assert ledger.usage().runtimes == 0


def _fit_at_ready(ready: float, length: float):
    """A placement policy for `place_busy`: start at `ready`, or after the intervals it would overlap."""

    def fit(blocked):
        start = ready
        for b0, b1 in sorted(blocked):
            if b0 < start + length and start < b1:
                start = b1
        return start, start + length, 1

    return fit


def test_a_placement_sees_what_another_process_placed_since_its_last_look(tmp_path):
    """Each process caches the intervals that block it; another process's write must invalidate that."""
    path = tmp_path / "gpu.ledger"
    ours, theirs = Ledger(path, 64 * MiB), Ledger(path, 64 * MiB)  # two file descriptions: two processes
    mine, other = 0, 1  # slots of two contexts (slots are per process: not acquired here)
    assert ours.place_busy(mine, False, 10.0, 0.0, _fit_at_ready(10.0, 1.0)) == (10.0, 11.0, 1)
    assert theirs.place_busy(other, False, 12.0, 0.0, _fit_at_ready(12.0, 1.0)) == (12.0, 13.0, 1)
    # our cache was filled before their write: a kernel ready at 12 must still go after it
    assert ours.place_busy(mine, False, 12.0, 0.0, _fit_at_ready(12.0, 1.0)) == (13.0, 14.0, 1)
    # and theirs after our two (one record, extended), nothing of their own in the way
    assert theirs.place_busy(other, False, 10.5, 0.0, _fit_at_ready(10.5, 0.5)) == (11.0, 11.5, 1)
    # MPS clients do not block one another; a context outside MPS still blocks them
    assert theirs.place_busy(other, True, 15.0, 0.0, _fit_at_ready(15.0, 1.0)) == (15.0, 16.0, 1)
    assert ours.place_busy(mine, True, 15.0, 0.0, _fit_at_ready(15.0, 1.0)) == (15.0, 16.0, 1)


def test_an_expired_record_of_another_context_that_our_write_replaced_blocks_nothing(tmp_path):
    """Our write may reuse the row of another context's expired interval: the intervals we cached
    before it (that one among them) must not block our next kernels."""
    path = tmp_path / "gpu.ledger"
    ours, theirs = Ledger(path, 64 * MiB), Ledger(path, 64 * MiB)
    mine, other = 0, 1
    assert theirs.place_busy(other, False, 1.0, 0.0, _fit_at_ready(1.0, 1.0)) == (1.0, 2.0, 1)
    assert ours.place_busy(mine, False, 5.0, 0.0, _fit_at_ready(5.0, 1.0)) == (5.0, 6.0, 1)  # cache: (1, 2)
    # at now=3 their (1, 2) has expired; our next record may take its row
    assert ours.place_busy(mine, False, 8.0, 3.0, _fit_at_ready(8.0, 1.0)) == (8.0, 9.0, 1)
    # their interval is gone from the ledger: a kernel ready at 1.5 starts at 1.5, not after it
    assert ours.place_busy(mine, False, 1.5, 3.0, _fit_at_ready(1.5, 0.25)) == (1.5, 1.75, 1)


def test_the_link_skips_a_dead_owners_copy_and_checks_a_live_one_once_per_ttl(tmp_path, monkeypatch):
    """A copy in flight whose process died shares the link with nobody; a live foreign owner is checked
    (a signal and a read of /proc, ~15 us) once per `LIVENESS_TTL_S`, not once per flow and call."""
    import streambox.device.ledger as ledger_module

    ledger = Ledger.open(ledger_path(tmp_path, 0, "link", 1000), 1000)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with monkeypatch.context() as m:
        m.setattr(os, "getpid", lambda: dead.pid)
        ledger.link_join("h2d", 0.0, 10.0)  # a copy of a process that then died
    flow, start, end = ledger.link_join("h2d", 0.0, 1.0)
    assert (start, end) == (0.0, 1.0)  # alone on the link: the dead copy takes no share
    assert ledger.link_poll("h2d", flow, 2.0) == (True, 1.0)

    checks = []
    alive = ledger_module.process_alive
    monkeypatch.setattr(ledger_module, "process_alive", lambda pid, *a: checks.append(pid) or alive(pid, *a))
    parent = os.getppid()
    with monkeypatch.context() as m:
        m.setattr(os, "getpid", lambda: parent)
        foreign = [ledger.link_join("h2d", 10.0, 1.0)[0] for _ in range(3)]  # a live process's copies
    ours, _, end = ledger.link_join("h2d", 10.0, 1.0)
    assert end == pytest.approx(14.0)  # four copies share the link
    ledger.link_poll("h2d", ours, 10.5)
    assert checks.count(parent) == 1  # three flows, several calls: one check within the TTL
    assert all(ledger.link_poll("h2d", f, 20.0)[0] for f in [*foreign, ours])


def test_a_short_copy_placed_alone_holds_the_link_and_a_busy_link_refuses_it(tmp_path):
    """`link_place_alone`: on an idle link the copy takes it whole; a copy arriving before its end
    starts at that end; with a copy in flight, or the link held past `latest`, nothing changes."""
    ledger = Ledger.open(ledger_path(tmp_path, 0, "link", 1000), 1000)
    assert ledger.link_place_alone("h2d", 5.0, 1.0, latest=5.0) == (5.0, 6.0)
    flow, start, end = ledger.link_join("h2d", 5.5, 2.0)  # arrived while the short copy held the link
    assert (start, end) == (6.0, 8.0)
    assert ledger.link_place_alone("h2d", 6.5, 0.5, latest=7.0) is None  # a flow in flight: share instead
    assert ledger.link_poll("h2d", flow, 8.0) == (True, 8.0)  # and the refusal changed nothing
    assert ledger.link_place_alone("d2h", 6.5, 0.5, latest=7.0) == (6.5, 7.0)  # a link of its own
    # placed copies queue behind each other only up to `latest`: a chain of them cannot run ahead
    assert ledger.link_place_alone("h2d", 9.0, 0.5, latest=9.0) == (9.0, 9.5)
    assert ledger.link_place_alone("h2d", 9.0, 0.5, latest=9.6) == (9.5, 10.0)
    assert ledger.link_place_alone("h2d", 9.0, 0.5, latest=9.6) is None  # it would enter at 10.0


def test_a_ledger_cut_short_is_named_with_its_remedy(tmp_path):
    """A truncated ledger file failed with mmap's "mmap length is greater than file size", naming
    neither the file nor what to do."""
    from streambox.device.base import DeviceError

    path = ledger_path(tmp_path, 0, "cut", 1000)
    Ledger(path, 1000)  # made whole
    os.truncate(path, 64)  # the header survives, the rest is gone
    with pytest.raises(DeviceError, match=r"ledger .* holds 64 bytes, its \d+ slots need \d+: it was cut"):
        Ledger(path, 1000)
