"""Mapping tables: per-node table, the in-memory global table and a node's periodic view of it."""

from __future__ import annotations

import pytest
import torch

from streambox.comm.tables import (
    HOST,
    GlobalView,
    InMemoryGlobalTable,
    Location,
    NodeTable,
    dtype_name,
    parse_dtype,
)


def loc(key: str, node: str, device: int = 0) -> Location:
    return Location(key, node, device, 0x1000, 64, "float16", (4, 8), (8, 1))


def test_location_round_trips_the_wire_and_dtypes_are_portable():
    original = loc("k", "n1", HOST)
    assert Location.from_wire(original.to_wire()) == original
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert parse_dtype("bfloat16") is torch.bfloat16 and parse_dtype("torch.int8") is torch.int8
    with pytest.raises(ValueError, match="unknown dtype 'nope'"):
        parse_dtype("nope")


def test_node_table_holds_only_its_node():
    table = NodeTable("n1")
    table.set(loc("a", "n1"))
    assert "a" in table and len(table) == 1 and table.get("a") == loc("a", "n1")
    with pytest.raises(ValueError, match="cannot hold a location on 'n2'"):
        table.set(loc("b", "n2"))
    assert table.remove("a") == loc("a", "n1") and table.remove("a") is None


def test_publish_replaces_a_nodes_entries_and_keeps_endpoints():
    table = InMemoryGlobalTable()
    table.publish("n1", "tcp://n1", {"a": loc("a", "n1"), "b": loc("b", "n1")})
    table.publish("n2", "tcp://n2", {"c": loc("c", "n2")})
    table.publish("n1", None, {"b": loc("b", "n1")})  # "a" was consumed on n1
    snap = table.snapshot()
    assert sorted(snap.entries) == ["b", "c"]
    assert snap.endpoints == {"n1": "tcp://n1", "n2": "tcp://n2"}


def test_a_key_on_two_nodes_resolves_to_the_first_node_name():
    table = InMemoryGlobalTable()
    table.publish("nb", None, {"k": loc("k", "nb")})
    table.publish("na", None, {"k": loc("k", "na")})
    assert table.snapshot().entries["k"].node == "na"


def test_view_refreshes_when_due_and_ignores_its_own_node():
    table = InMemoryGlobalTable()
    table.publish("me", "tcp://me", {"mine": loc("mine", "me")})
    table.publish("other", "tcp://other", {"theirs": loc("theirs", "other")})
    view = GlobalView("me", refresh_s=1.0)
    assert view.due(0.0)
    view.apply(table.snapshot(), now=10.0)
    assert not view.due(10.999) and view.due(11.0) and view.next_due() == 11.0
    assert view.lookup("mine") is None  # the node table answers for this node
    assert view.lookup("theirs") == loc("theirs", "other")
    assert view.endpoint("other") == "tcp://other" and view.endpoint("nobody") is None
    with pytest.raises(ValueError):
        GlobalView("me", refresh_s=0)
