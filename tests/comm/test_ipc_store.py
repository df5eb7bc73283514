"""The CUDA-IPC style store (stream-only's data path) on an emulated node: fresh allocations outside any
pool, copies on PUT, handles opened on GET at their modelled cost, host memory when the GPU is full."""

from __future__ import annotations

import pytest
import torch

from streambox.comm import CommStore, StoreConfig, Transport
from streambox.comm.errors import GetTimeout, KeyExists
from streambox.comm.ipc_store import IpcCosts, IpcStore
from streambox.comm.store_protocol import Store, adopted
from streambox.device.specs import MiB

from .conftest import SPEC


def _device_tensor(rt, data: torch.Tensor):
    from streambox.api_proxy.device_tensor import upload_tensor

    stream = rt.create_stream()
    t = upload_tensor(rt, data, lambda n, s: rt.mem_alloc(n), stream)
    stream.synchronize()
    return t, stream


@pytest.fixture
def store(runtimes):
    s = IpcStore(runtimes, node="n0")
    yield s
    s.close()


def test_both_stores_are_the_protocol(runtimes, allocators, store):
    managed = CommStore(runtimes, allocators)
    try:
        assert isinstance(store, Store) and isinstance(managed, Store)
    finally:
        managed.close()


def test_put_copies_into_a_fresh_allocation_and_get_opens_it(runtimes, store):
    rt = runtimes[0]
    data = torch.arange(1024, dtype=torch.float32)
    t, stream = _device_tensor(rt, data)
    held = rt.allocated_bytes()
    loc = store.put("k", t, device=0, consumers=1, stream=stream)
    assert not adopted(loc, t, 0) and loc.device == 0  # a copy: the producer keeps its buffer
    assert rt.allocated_bytes() >= held + t.nbytes  # the device ledger moved (outside any pool)
    assert store.usage()[0] == t.nbytes
    stream.synchronize()  # the copy was issued on the producer's stream: its buffer may go after it
    rt.mem_free(t.address)
    h = store.get("k", device=0, timeout=1.0, owner="f")
    assert h.transport is Transport.IPC and h.address == loc.address
    h.ready.synchronize()
    assert torch.equal(h.view(rt).clone(), data)
    assert store.keys() == []  # consumed by its one consumer
    h.release()
    assert store.stats.device_frees == 1 and store.usage()[0] == 0
    spent = store.stats.modelled_host_s
    costs = IpcCosts()
    assert spent["open"] == pytest.approx(costs.ipc.open_s)
    assert spent["export"] == pytest.approx(costs.ipc.export_s)
    assert spent["close"] == pytest.approx(costs.ipc.close_s)
    assert spent["malloc"] == pytest.approx(costs.malloc_s)


def test_gpu_full_spills_to_host_and_get_copies_back(runtimes, store):
    rt = runtimes[0]
    data = torch.full((4 * MiB // 4,), 7.0)
    t, stream = _device_tensor(rt, data)
    filler = rt.mem_alloc(rt.memory_info()[0] - MiB)  # the GPU is full but for 1 MiB
    try:
        loc = store.put("big", t, device=0, stream=stream)
        assert loc.device == -1 and store.stats.spills == 1  # host memory
        rt.mem_free(filler)
        h = store.get("big", device=0, timeout=1.0)
        assert h.transport is Transport.HOST and h.address != t.address
        h.ready.synchronize()
        assert torch.equal(h.view(rt).clone(), data)
        h.release()
    finally:
        if store.stats.spills == 0:
            rt.mem_free(filler)
    assert store.delete("big") and store.keys() == []


def test_get_waits_times_out_and_put_refuses_a_held_key(runtimes, store):
    rt = runtimes[0]
    with pytest.raises(GetTimeout, match="never PUT"):
        store.get("later", device=0, timeout=0.01)
    woke = []
    store.watch("later", lambda: woke.append(1))
    store.put("later", torch.ones(4), device=0)
    assert woke == [1]
    with pytest.raises(KeyExists):
        store.put("later", torch.ones(4), device=0)
    store.put("later", torch.zeros(4), device=0, overwrite=True)
    h = store.get("later", device=0, owner="f")
    h.ready.synchronize()
    assert torch.equal(h.view(rt).clone(), torch.zeros(4))
    assert store.release_owner("f") == 1 and h.released
    assert store.delete("later")
    with pytest.raises(GetTimeout, match="deleted"):
        store.get("later", device=0, timeout=0.0)


def test_a_reader_on_another_gpu_gets_a_peer_copy(runtimes, store):
    data = torch.arange(256, dtype=torch.int32)
    store.put("x", data, device=0)
    h = store.get("x", device=1)
    assert h.transport is Transport.PEER and h.device == 1
    h.ready.synchronize()
    assert torch.equal(h.view(runtimes[1]).clone(), data)
    h.release()


def test_ttl_and_quota_as_the_managed_store(runtimes):
    from streambox.comm.quota import QuotaExceeded, StoreQuota

    store = IpcStore(runtimes, config=StoreConfig(quota=StoreQuota(max_keys=1)))
    try:
        store.put("a", torch.ones(4), device=0, ttl=0.01)
        with pytest.raises(QuotaExceeded):
            store.put("b", torch.ones(4), device=0)
        import time

        time.sleep(0.02)
        assert store.keys() == [] and store.stats.expired_keys == 1
    finally:
        store.close()
    assert SPEC.total_memory  # the fixture's small GPUs


def test_a_writer_is_held_to_its_share_as_in_the_managed_store(runtimes):
    from streambox.comm.quota import QuotaExceeded, StoreQuota

    store = IpcStore(runtimes, config=StoreConfig(quota=StoreQuota(max_bytes=128, writer_share=0.25)))
    try:
        store.put("a", torch.ones(8), device=0, writer="f")  # 32 bytes: its whole share
        with pytest.raises(QuotaExceeded, match="above its share of 32 bytes"):
            store.put("b", torch.ones(1), device=0, writer="f")
        store.put("c", torch.ones(8), device=0, writer="g")
        lease = store.get("c", device=0, owner="r")
        assert store.delete("c")  # a reader still holds it: its bytes are still g's
        with pytest.raises(QuotaExceeded, match="function 'g'.* above its share of 32 bytes"):
            store.put("c2", torch.ones(1), device=0, writer="g")
        lease.ready.synchronize()  # read, as a reader does, then released: the store frees it now
        lease.release()
        store.put("c2", torch.ones(1), device=0, writer="g")
        assert store.delete("a")
        store.put("b", torch.ones(1), device=0, writer="f")
        assert sorted(store.keys()) == ["b", "c2"]
    finally:
        store.close()


def test_a_refused_put_frees_its_copy_only_after_the_copy_ran(runtimes):
    """The quota is checked once the copy is issued: a refused PUT's allocation waits for that copy."""
    import time

    from streambox.comm.quota import QuotaExceeded, StoreQuota

    rt = runtimes[0]
    store = IpcStore(runtimes, config=StoreConfig(quota=StoreQuota(max_bytes=1024)))
    try:
        t, stream = _device_tensor(rt, torch.ones(1024))  # 4 KiB: over the quota
        rt.launch(stream, lambda: time.sleep(0.3))  # the producer's stream is busy: the copy waits
        with pytest.raises(QuotaExceeded):
            store.put("big", t, device=0, stream=stream)
        assert not store.delete("other")  # a call that frees what is due: not this block yet
        stream.synchronize()  # raises if the copy met a freed destination
        rt.mem_free(t.address)
    finally:
        store.close()
    assert store.stats.device_frees == 1
