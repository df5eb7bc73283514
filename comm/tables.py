"""Mapping tables: where the data of each key lives.

- `NodeTable`: this node's keys (key -> node, device, address, size, dtype, shape, strides). The store
  keeps it current under its lock; a GET searches it first.
- `GlobalTable`: every node's keys, behind an interface. `InMemoryGlobalTable` serves the nodes of one
  process; `streambox.comm.rpc.RpcGlobalTable` asks peer nodes over pyzmq; a later issue backs the
  interface with a real distributed store.
- `GlobalView`: one node's cached snapshot of the global table, refreshed every `refresh_s` (1 s by
  default, as in the paper). Pure: it is told `now` and what the table said; it never calls anything.

A GET that misses the node table looks in the view; a key absent from both is waited for, and the view
is refreshed whenever it is due, so that a key PUT on another node becomes visible within one refresh
period of the publishing node plus one of the reading node.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

#: `Location.device` of data held in host memory.
HOST = -1


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: the portable spelling used in tables and on the wire."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@dataclass(frozen=True)
class Location:
    """One key's entry: the node and device (GPU index, or HOST) holding its bytes, and their layout."""

    key: str
    node: str
    device: int
    address: int  # device address; 0 for host memory
    nbytes: int  # bytes spanned by the tensor (its strided extent)
    dtype: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    def to_wire(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "node": self.node,
            "device": self.device,
            "address": self.address,
            "nbytes": self.nbytes,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "strides": list(self.strides),
        }

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> Location:
        return cls(
            str(d["key"]),
            str(d["node"]),
            int(d["device"]),
            int(d["address"]),
            int(d["nbytes"]),
            str(d["dtype"]),
            tuple(int(x) for x in d["shape"]),
            tuple(int(x) for x in d["strides"]),
        )


class NodeTable:
    """The per-node mapping table. Not locked itself: the store mutates it under its own lock."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._entries: dict[str, Location] = {}

    def set(self, location: Location) -> None:
        if location.node != self.node:
            raise ValueError(f"node table of {self.node!r} cannot hold a location on {location.node!r}")
        self._entries[location.key] = location

    def remove(self, key: str) -> Location | None:
        return self._entries.pop(key, None)

    def get(self, key: str) -> Location | None:
        return self._entries.get(key)

    def snapshot(self) -> dict[str, Location]:
        return dict(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries


@dataclass(frozen=True)
class GlobalSnapshot:
    """What the global table says at one moment: every published key, and how to reach each node."""

    entries: dict[str, Location] = field(default_factory=dict)
    endpoints: dict[str, str] = field(default_factory=dict)


class GlobalTable(Protocol):
    """The cross-node table. `publish` replaces everything a node published before."""

    def publish(self, node: str, endpoint: str | None, entries: Mapping[str, Location]) -> None: ...

    def snapshot(self) -> GlobalSnapshot: ...


def merge_nodes(tables: Mapping[str, Mapping[str, Location]], endpoints: Mapping[str, str]) -> GlobalSnapshot:
    """One snapshot from per-node tables. A key published by two nodes (a stale entry racing a fresh
    one) resolves to the node whose name sorts first, so that every reader picks the same one."""
    entries: dict[str, Location] = {}
    for node in sorted(tables, reverse=True):
        entries.update(tables[node])
    return GlobalSnapshot(entries, dict(endpoints))


class InMemoryGlobalTable:
    """A global table shared by the nodes (stores) of one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tables: dict[str, dict[str, Location]] = {}
        self._endpoints: dict[str, str] = {}

    def publish(self, node: str, endpoint: str | None, entries: Mapping[str, Location]) -> None:
        with self._lock:
            self._tables[node] = dict(entries)
            if endpoint is not None:
                self._endpoints[node] = endpoint

    def snapshot(self) -> GlobalSnapshot:
        with self._lock:
            return merge_nodes(self._tables, self._endpoints)


class GlobalView:
    """A node's cached view of the global table (pure: no clock, no I/O)."""

    def __init__(self, node: str, refresh_s: float = 1.0) -> None:
        if not refresh_s > 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s}")
        self.node = node
        self.refresh_s = refresh_s
        self.refreshed_at = -math.inf
        self._snapshot = GlobalSnapshot()

    def due(self, now: float) -> bool:
        return now - self.refreshed_at >= self.refresh_s

    def next_due(self) -> float:
        return self.refreshed_at + self.refresh_s

    def apply(self, snapshot: GlobalSnapshot, now: float) -> None:
        self._snapshot = snapshot
        self.refreshed_at = now

    def lookup(self, key: str) -> Location | None:
        """The key's location on *another* node (this node's own entries come from its node table)."""
        location = self._snapshot.entries.get(key)
        return None if location is None or location.node == self.node else location

    def endpoint(self, node: str) -> str | None:
        return self._snapshot.endpoints.get(node)
