"""Processor sharing of one link direction between copies in flight (`link_share.py`, pure)."""

from __future__ import annotations

import pytest

from streambox.device.link_share import Flow, advance, finish_times


def test_a_copy_alone_ends_after_its_cost_and_two_share_the_link():
    assert finish_times([Flow(1, 2.0)], 10.0) == {1: 12.0}
    # 1 s and 3 s of work at once: the short one ends at 2 s (half speed), the long one at 4 s
    assert finish_times([Flow(1, 1.0), Flow(2, 3.0)], 0.0) == {1: 2.0, 2: 4.0}


def test_advance_keeps_the_work_left_and_reports_departures():
    active, ends = advance([Flow(1, 1.0), Flow(2, 3.0)], 0.0, 3.0)
    assert ends == {1: 2.0}
    (left,) = active
    assert left.flow_id == 2 and left.left == pytest.approx(1.0)  # 1 s at half speed, 1 s alone
    active, ends = advance([Flow(1, 1.0), Flow(2, 3.0)], 0.0, 1.0)
    assert ends == {} and [f.left for f in active] == pytest.approx([0.5, 2.5])


def test_a_late_arrival_slows_the_copy_in_flight():
    active, _ = advance([Flow(1, 2.0)], 0.0, 1.0)  # half done when the second arrives
    ends = finish_times([*active, Flow(2, 2.0)], 1.0)
    assert ends == {1: pytest.approx(3.0), 2: pytest.approx(4.0)}
