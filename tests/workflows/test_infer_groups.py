"""`InferGroups`, the pure policy of which `infer` calls of one batched message run together."""

from __future__ import annotations

import pytest

from streambox.api_proxy.batcher import Limits
from streambox.workflows.infer_groups import InferGroups

LIMITS = Limits(max_samples=4, max_delay_s=0.05)


def _members(groups: list) -> list[list[str]]:
    return [list(g.members) for g in groups]


def test_a_group_closes_once_every_running_member_waits_in_it() -> None:
    groups: InferGroups[str] = InferGroups(3, LIMITS)
    assert groups.join("m", "a", 1, now=0.0) == []
    assert groups.join("m", "b", 1, now=0.001) == []
    assert _members(groups.join("m", "c", 1, now=0.002)) == [["a", "b", "c"]]  # nobody else can come
    assert len(groups) == 0


def test_a_finished_member_no_longer_holds_the_others() -> None:
    groups: InferGroups[str] = InferGroups(3, LIMITS)
    groups.join("m", "a", 1, now=0.0)
    groups.join("other-shape", "b", 1, now=0.0)
    assert _members(groups.finished()) == [["a"], ["b"]]  # the third raised before its infer


def test_full_groups_close_and_waiting_ones_close_at_their_deadline() -> None:
    groups: InferGroups[str] = InferGroups(6, LIMITS)
    assert groups.join("m", "a", 3, now=0.0) == []
    assert _members(groups.join("m", "b", 2, now=0.01)) == [["a"]]  # b would overflow a's group
    assert groups.next_deadline() == pytest.approx(0.06)
    assert groups.due(0.05) == [] and _members(groups.due(0.07)) == [["b"]]


def test_members_whose_group_ran_may_join_again() -> None:
    groups: InferGroups[str] = InferGroups(2, LIMITS)
    groups.join("m", "a", 1, now=0.0)
    assert _members(groups.join("m", "b", 1, now=0.0)) == [["a", "b"]]
    groups.resumed(2)  # the group ran; both handlers go on to a second infer
    assert groups.join("m", "a2", 1, now=1.0) == []
    assert _members(groups.join("m", "b2", 1, now=1.0)) == [["a2", "b2"]]
    with pytest.raises(RuntimeError, match="more members"):
        groups.finished()
