"""The issuer's pacing and cancellation (`api_proxy/issuer.py`), with this test as the dispatcher: it
grants the turns. The issues are plain functions that call the per-kernel hook as the executor does."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from streambox.api_proxy.issuer import IssueCancelled, Issuer

WAIT_S = 30.0


def _issue(name: str, kernels: int, log: list[tuple[str, int]], outputs: dict[str, Any] | None = None):
    def issue(on_kernel: Callable[[int, Any], None]) -> Any:
        for index in range(kernels):
            on_kernel(index, None)
            log.append((name, index))
        return SimpleNamespace(outputs=outputs or {})

    return issue


def _until(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.001)


def test_an_issue_runs_a_slice_per_dispatcher_turn() -> None:
    issuer = Issuer(lambda: None, threads=2, slice_kernels=4)
    log: list[tuple[str, int]] = []
    frees: list[Any] = []
    try:
        a = issuer.submit(_issue("a", 12, log), lambda addresses, stream: frees.append(addresses), None)
        _until(lambda: len(issuer.waiting) == 1)
        assert log == [("a", 0), ("a", 1), ("a", 2)]  # up to its first boundary, and no further
        while not a.future.done():
            before = len(log)
            if issuer.waiting:
                issuer.grant()
                _until(lambda: len(issuer.waiting) >= 1 or a.future.done())
                _until(lambda before=before: len(log) > before)
                assert len(log) - before <= 4  # one slice per turn
        assert a.future.result(WAIT_S)[0] and [i for _, i in log] == list(range(12)) and frees == []
    finally:
        issuer.close()


def test_two_issues_take_the_floor_slice_by_slice_and_a_small_one_waits_one_slice() -> None:
    issuer = Issuer(
        lambda: None, threads=3, slice_kernels=4, contended=lambda: False, floor_patience_s=WAIT_S
    )
    log: list[tuple[str, int]] = []
    go = threading.Event()

    def gated(issue):
        def run(on_kernel):
            go.wait(WAIT_S)
            return issue(on_kernel)

        return run

    try:
        a = issuer.submit(gated(_issue("a", 12, log)), lambda *args: None, None)
        _until(lambda: not go.is_set() and issuer.floor.held)  # a holds the floor, not issuing yet
        b = issuer.submit(_issue("b", 12, log), lambda *args: None, None)
        _until(issuer.floor.contended)  # b waits for the floor
        go.set()
        assert a.future.result(WAIT_S)[0] and b.future.result(WAIT_S)[0]
        runs = [(name, len(list(group))) for name, group in itertools.groupby(n for n, _ in log)]
        assert runs == [("a", 3), ("b", 3), ("a", 4), ("b", 4), ("a", 4), ("b", 4), ("a", 1), ("b", 1)]
        assert [i for n, i in log if n == "a"] == list(range(12))  # each issue in its own order
        # A one-kernel issue submitted while a long one runs gets the floor at the next boundary.
        log.clear()
        go.clear()
        long = issuer.submit(gated(_issue("long", 40, log)), lambda *args: None, None)
        _until(lambda: issuer.floor.held)
        small = issuer.submit(_issue("small", 1, log), lambda *args: None, None)
        _until(issuer.floor.contended)
        go.set()
        assert small.future.result(WAIT_S)[0] and long.future.result(WAIT_S)[0]
        assert log.index(("small", 0)) == 3  # after the long one's first slice (its boundary: kernel 3)
    finally:
        issuer.close()


def test_an_issue_goes_on_without_the_floor_when_its_holder_does_not_move() -> None:
    # A holder stuck (e.g. in the pool's slow path, waiting for memory only the others' progress frees)
    # must not stop the waiting issues: after the floor's patience they issue without it.
    issuer = Issuer(lambda: None, threads=2, slice_kernels=4, contended=lambda: False, floor_patience_s=0.05)
    log: list[tuple[str, int]] = []
    stuck = threading.Event()

    def held_forever(on_kernel):
        stuck.wait(WAIT_S)
        return _issue("a", 4, log)(on_kernel)

    try:
        a = issuer.submit(held_forever, lambda *args: None, None)
        _until(lambda: issuer.floor.held)
        b = issuer.submit(_issue("b", 6, log), lambda *args: None, None)
        assert b.future.result(WAIT_S)[0] and log == [("b", i) for i in range(6)]  # while a still holds it
        assert not a.future.done() and not issuer.floor.contended()  # b left the queue
        stuck.set()
        assert a.future.result(WAIT_S)[0] and not issuer.floor.held  # released by its holder
    finally:
        stuck.set()
        issuer.close()


def test_an_issue_alone_takes_no_turns_until_the_dispatcher_has_work() -> None:
    busy = threading.Event()
    issuer = Issuer(lambda: None, threads=1, slice_kernels=2, contended=busy.is_set)
    log: list[tuple[str, int]] = []
    try:
        alone = issuer.submit(_issue("a", 10, log), lambda *a: None, None)
        assert alone.future.result(WAIT_S)[0] and len(log) == 10  # no turn was ever granted
        busy.set()  # the dispatcher has work: the next issue waits at its first boundary
        waits = issuer.submit(_issue("b", 10, log), lambda *a: None, None)
        _until(lambda: issuer.waiting)
        assert log[10:] == [("b", 0)] and not waits.future.done()
        busy.clear()
        issuer.grant()  # one turn; nobody waits any more, so the rest runs without turns
        assert waits.future.result(WAIT_S)[0] and [i for n, i in log if n == "b"] == list(range(10))
    finally:
        issuer.close()


def test_a_contention_check_that_trips_on_a_changing_collection_counts_as_contended() -> None:
    def resized() -> bool:
        raise RuntimeError("dictionary changed size during iteration")

    assert Issuer(lambda: None, threads=1, contended=resized).is_contended()
    assert not Issuer(lambda: None, threads=1, contended=lambda: False).is_contended()


def test_a_cancelled_issue_stops_at_its_next_kernel_and_a_finished_one_frees_its_outputs() -> None:
    issuer = Issuer(lambda: None, threads=1, slice_kernels=2)
    log: list[tuple[str, int]] = []
    freed: list[list[int]] = []
    try:
        ticket = issuer.submit(_issue("a", 10, log), lambda addresses, stream: freed.append(addresses), None)
        _until(lambda: issuer.waiting)
        assert ticket.cancel(WAIT_S) is None  # not delivered: the issue stopped
        ok, error = ticket.future.result(WAIT_S)
        assert not ok and isinstance(error, IssueCancelled)
        assert log == [("a", 0)]

        # A run that finishes before the cancel is seen: delivered, the canceller frees its outputs.
        done = issuer.submit(_issue("b", 1, log, {"y": SimpleNamespace(address=7)}), lambda *a: None, None)
        assert done.future.result(WAIT_S)[0]
        assert done.cancel(WAIT_S).outputs["y"].address == 7
    finally:
        issuer.close()


def test_closing_lets_an_issue_waiting_for_a_turn_finish() -> None:
    issuer = Issuer(lambda: None, threads=1, slice_kernels=1)
    log: list[tuple[str, int]] = []
    ticket = issuer.submit(_issue("a", 3, log), lambda *a: None, None)
    _until(lambda: issuer.waiting)
    closer = threading.Thread(target=issuer.close)
    closer.start()
    closer.join(WAIT_S)
    assert not closer.is_alive() and ticket.future.result(0)[0] and len(log) == 3


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="slice_kernels"):
        Issuer(lambda: None, slice_kernels=0)
