"""The proxy's invocation scheduler: a pure policy, tested by the exact actions it returns."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from streambox.api_proxy.scheduler import Dispatch, Expire, InvocationScheduler, Start, Stop


@dataclass(eq=False)
class Inv:
    name: str
    deadline: float = 1e9


def test_new_instances_up_to_the_limit_then_queue_then_the_freed_instance_takes_the_oldest():
    s = InvocationScheduler({"f": 2}, keep_alive_s=10.0)
    a, b, c, d = Inv("a"), Inv("b"), Inv("c"), Inv("d")
    assert s.submit("f", a, 0.0) == Start("f", 1, a)
    assert s.submit("f", b, 0.0) == Start("f", 2, b)
    assert s.submit("f", c, 1.0) is None
    assert s.submit("f", d, 1.0) is None
    assert s.summary() == {"f": {"instances": 2, "idle": 0, "busy": 2, "queued": 2}}
    assert s.finished("f", 2, 2.0) == Dispatch(2, c)
    assert s.finished("f", 1, 2.5) == Dispatch(1, d)
    assert s.finished("f", 1, 3.0) is None
    assert s.summary()["f"] == {"instances": 2, "idle": 1, "busy": 1, "queued": 0}


def test_a_warm_request_takes_the_most_recently_used_idle_instance():
    s = InvocationScheduler({"f": 3}, keep_alive_s=10.0)
    for i in range(3):
        s.submit("f", Inv(str(i)), 0.0)
    s.finished("f", 1, 1.0)
    s.finished("f", 3, 3.0)
    s.finished("f", 2, 2.0)
    e = Inv("e")
    assert s.submit("f", e, 4.0) == Dispatch(3, e)


def test_functions_are_independent():
    s = InvocationScheduler({"f": 1, "g": 1}, keep_alive_s=10.0)
    x, y, z = Inv("x"), Inv("y"), Inv("z")
    assert s.submit("f", x, 0.0) == Start("f", 1, x)
    assert s.submit("g", y, 0.0) == Start("g", 2, y)
    assert s.submit("f", z, 0.0) is None
    assert s.finished("g", 2, 1.0) is None  # g's idle instance does not serve f's queue
    assert s.summary()["f"]["queued"] == 1


def test_a_removed_instance_lets_queued_requests_start_new_ones():
    s = InvocationScheduler({"f": 1}, keep_alive_s=10.0)
    a, b, c = Inv("a"), Inv("b"), Inv("c")
    s.submit("f", a, 0.0)
    s.submit("f", b, 0.0)
    s.submit("f", c, 0.0)
    assert s.removed("f", 1, 1.0) == [Start("f", 2, b)]  # one slot: one start, c stays queued
    assert s.summary()["f"] == {"instances": 1, "idle": 0, "busy": 1, "queued": 1}
    assert s.removed("f", 99, 1.0) == []  # an unknown instance frees no slot


def test_tick_expires_queued_requests_oldest_first_and_stops_idle_instances_after_keep_alive():
    s = InvocationScheduler({"f": 1, "g": 1}, keep_alive_s=5.0)
    s.submit("f", Inv("run", deadline=100.0), 0.0)
    late, later = Inv("late", deadline=2.0), Inv("later", deadline=3.0)
    s.submit("f", late, 0.0)
    s.submit("f", later, 0.0)
    s.submit("g", Inv("g"), 0.0)
    s.finished("g", 2, 1.0)
    assert s.next_due() == 2.0
    assert s.tick(1.9) == []
    assert s.tick(2.5) == [Expire("f", late)]
    assert s.next_due() == 3.0
    assert s.tick(6.0) == [Expire("f", later), Stop("g", 2)]
    assert s.summary()["g"]["instances"] == 0
    assert s.next_due() is None  # f's instance is busy, nothing queued


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="max_instances"):
        InvocationScheduler({"f": 0})
    with pytest.raises(ValueError, match="keep_alive_s"):
        InvocationScheduler({"f": 1}, keep_alive_s=-1.0)


def test_prewarm_starts_instances_without_a_request_that_go_idle_and_take_the_first_requests():
    s = InvocationScheduler({"f": 2, "g": 1}, keep_alive_s=10.0)
    assert s.prewarm("f", 3, 0.0) == [Start("f", 1, None), Start("f", 2, None)]  # within its limit
    assert s.prewarm("g", 0, 0.0) == []
    assert s.summary()["f"] == {"instances": 2, "idle": 0, "busy": 2, "queued": 0}  # starting
    assert s.finished("f", 1, 1.0) is None and s.finished("f", 2, 1.5) is None  # registered: idle
    a, b = Inv("a"), Inv("b")
    assert s.submit("f", a, 2.0) == Dispatch(2, a)
    assert s.submit("f", b, 2.0) == Dispatch(1, b)
    assert s.prewarm("f", 1, 3.0) == []  # full


def test_withdraw_takes_an_ended_request_s_queued_invocations_and_keeps_the_order_of_the_rest():
    s = InvocationScheduler({"f": 1, "g": 1}, keep_alive_s=10.0)
    running, a1, b1, a2, g1, g2 = Inv("run"), Inv("a1"), Inv("b1"), Inv("a2"), Inv("g1"), Inv("a3")
    s.submit("f", running, 0.0)
    for inv in (a1, b1, a2):
        assert s.submit("f", inv, 0.0) is None
    s.submit("g", g1, 0.0)
    assert s.submit("g", g2, 0.0) is None
    taken = s.withdraw(lambda inv: inv.name.startswith("a"))
    assert [(f, inv.name) for f, inv in taken] == [("f", "a1"), ("f", "a2"), ("g", "a3")]
    assert s.summary()["f"]["queued"] == 1 and s.summary()["g"]["queued"] == 0
    assert s.finished("f", 1, 1.0) == Dispatch(1, b1)  # the rest in their order
    assert s.withdraw(lambda inv: True) == []  # nothing queued: nothing taken
