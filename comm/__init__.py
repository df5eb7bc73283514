"""Unified communication (paper section 6): PUT/GET by key, mapping tables, transports chosen by
location (same GPU: the address; another GPU: a peer copy; another node: RPC), and the elastic
communication store with pressure awareness (PA) and adaptive movement (AM).

pyzmq is imported only by `streambox.comm.rpc` (cross-node), redis only by `streambox.comm.baselines`.
"""

from .client import FunctionClient
from .config import IdlePredictor, StoreConfig
from .errors import CommError, GetTimeout, KeyExists, RemoteError, StoreClosed
from .lease import Allocator, Lease, StoreStats, Transport
from .policy import HOST, GpuState, ItemState, Move, place, plan_moves, relocate_on_read, store_capacity
from .store import CommStore
from .tables import GlobalSnapshot, GlobalTable, GlobalView, InMemoryGlobalTable, Location, NodeTable

__all__ = [
    "HOST",
    "Allocator",
    "CommError",
    "CommStore",
    "FunctionClient",
    "GetTimeout",
    "GlobalSnapshot",
    "GlobalTable",
    "GlobalView",
    "GpuState",
    "Lease",
    "IdlePredictor",
    "InMemoryGlobalTable",
    "ItemState",
    "KeyExists",
    "Location",
    "Move",
    "NodeTable",
    "RemoteError",
    "StoreClosed",
    "StoreConfig",
    "StoreStats",
    "Transport",
    "place",
    "plan_moves",
    "relocate_on_read",
    "store_capacity",
]
