"""Cross-node GET over pyzmq: two nodes in one process, and a real second process."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from streambox.api_proxy.device_tensor import download_tensor
from streambox.comm import CommStore, GetTimeout, InMemoryGlobalTable, StoreConfig, Transport
from streambox.comm.rpc import RpcGlobalTable, RpcServer, fetch_remote
from streambox.device.specs import MiB

KiB = 1 << 10
CHUNK = 256 * KiB
FAST = StoreConfig(global_refresh_s=0.05, rpc_chunk_bytes=CHUNK, rpc_pipeline=2)


def read(store: CommStore, handle) -> torch.Tensor:
    rt = store.runtime(handle.device)
    stream = rt.create_stream()
    try:
        return download_tensor(rt, handle, stream)
    finally:
        stream.destroy()


@pytest.fixture
def two_nodes(runtimes, allocators):
    """Node A (GPU 0) and node B (GPUs 1, 2) sharing an in-memory global table; B serves RPC."""
    table = InMemoryGlobalTable()
    a = CommStore({0: runtimes[0]}, {0: allocators[0]}, node="A", idle={0: 32 * MiB}, config=FAST,
                  global_table=table)
    b = CommStore({1: runtimes[1], 2: runtimes[2]}, {1: allocators[1], 2: allocators[2]}, node="B",
                  idle={1: 32 * MiB, 2: 32 * MiB}, config=FAST, global_table=table)
    server = RpcServer(b)
    a.start()  # the tickers publish and refresh the global table every 50 ms
    b.start()
    yield a, b
    server.close()
    a.close()
    b.close()


def test_get_of_a_key_on_another_node_streams_it_over_rpc(two_nodes):
    a, b = two_nodes
    n = 3 * MiB // 4  # 3 MiB of float32: 12 chunks of 256 KiB
    b.put("x", torch.arange(n, dtype=torch.float32), device=2, consumers=1)
    with a.get("x", device=0, timeout=5) as h:
        assert h.transport is Transport.RPC and h.device == 0
        assert torch.equal(read(a, h), torch.arange(n, dtype=torch.float32))
    assert a.stats.rpc_chunks == 12 and 0 < a.stats.rpc_max_in_flight_bytes <= 2 * CHUNK
    b.synchronize()
    assert b.keys() == [] and b.usage()[2] == 0 and b.held_leases() == 0  # consumed on B, freed


def test_cross_node_get_before_put_waits_for_the_global_table(two_nodes):
    a, b = two_nodes
    threading.Timer(0.1, lambda: b.put("late", torch.ones(10), device=1)).start()
    started = time.monotonic()
    with a.get("late", device=0, timeout=5) as h:  # A and B refresh every 50 ms
        assert h.transport is Transport.RPC and time.monotonic() - started >= 0.1
        assert torch.equal(read(a, h), torch.ones(10))


def test_delete_reaches_the_owning_node(two_nodes):
    a, b = two_nodes
    b.put("d", torch.ones(10), device=1)
    b.sync_global()  # publish now rather than at the next tick
    a.sync_global()
    assert a.delete("d") and b.keys() == []


def test_fetch_of_a_key_the_node_no_longer_holds_is_none(two_nodes):
    _, b = two_nodes
    assert fetch_remote(b.endpoint, "absent", lambda info: None, owner="t") is None


# -- a real second process ------------------------------------------------------------------------
class RemoteNode:
    def __init__(self, tmp_path: Path) -> None:
        script = Path(__file__).with_name("remote_node.py")
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "node-b-state")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tmp_path,
        )
        self.endpoint = self._answer()["endpoint"]

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"node B exited with {self.proc.wait()}")
        return json.loads(line)

    def send(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def node_b(tmp_path_factory):
    node = RemoteNode(tmp_path_factory.mktemp("node-b"))
    yield node
    node.close()
    assert node.proc.returncode == 0


@pytest.fixture
def node_a(runtimes, allocators, node_b):
    store = CommStore({0: runtimes[0]}, {0: allocators[0]}, node="A", idle={0: 32 * MiB}, config=FAST,
                      global_table=RpcGlobalTable({"B": node_b.endpoint}))
    yield store
    store.close()


def test_get_from_a_node_in_another_process(node_a, node_b):
    n = 5 * MiB // 4 + 3  # 5 MiB and 12 bytes: the last chunk is short
    node_b.send(op="put", key="y", n=n, seed=7, consumers=1)
    with node_a.get("y", device=0, timeout=10) as h:
        assert h.transport is Transport.RPC
        assert torch.equal(read(node_a, h), torch.arange(n, dtype=torch.float32) + 7)
    assert node_a.stats.rpc_chunks == 21 and node_a.stats.rpc_max_in_flight_bytes <= 2 * CHUNK
    stats = node_b.send(op="stats")
    assert stats == {"used": 0, "keys": [], "leases": 0, "pool_used": 0}  # consumed and freed on B
    with pytest.raises(GetTimeout, match="'y'"):
        node_a.get("y", device=0, timeout=0.2)


def test_get_waits_for_a_put_in_another_process(node_a, node_b):
    started = time.monotonic()
    node_b.send(op="put", key="z", n=100, seed=1, consumers=1, delay=0.3)
    with node_a.get("z", device=0, timeout=10) as h:
        assert time.monotonic() - started >= 0.3
        assert torch.equal(read(node_a, h), torch.arange(100, dtype=torch.float32) + 1)
