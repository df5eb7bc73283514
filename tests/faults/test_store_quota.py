"""Bounds of the communication store: the pure quota policy, exactly, and the store refusing a PUT
over a bound with a clear error while every earlier key keeps its bytes and a refused PUT leaves none
behind."""

from __future__ import annotations

import math
import time

import pytest
import torch

from streambox.api_proxy.executor import StreamPoolAllocator
from streambox.comm import CommStore, StoreConfig
from streambox.comm.quota import (
    QuotaExceeded,
    StoreQuota,
    Usage,
    WriterTally,
    check_put,
    check_ttl,
    host_allows,
)
from streambox.device.emulated import EmulatedBackend
from streambox.device.specs import V100_16GB, MiB

SPEC = V100_16GB.with_overrides(
    name="quota-gpu", total_memory=16 * MiB, context_create_s=0.0, context_memory=0
)


def test_ttl_ceiling_and_bad_ttls():
    q = StoreQuota(max_ttl_s=60.0)
    check_ttl(q, "k", None)
    check_ttl(q, "k", 60.0)
    with pytest.raises(QuotaExceeded, match=r"PUT 'k': ttl 1e\+300 s is above the store's ceiling of 60 s"):
        check_ttl(q, "k", 1e300)
    for bad in (0, -1.0, math.nan, math.inf, "5"):
        with pytest.raises(ValueError, match="ttl must be a finite number of seconds > 0 or None"):
            check_ttl(q, "k", bad)
    check_ttl(StoreQuota(max_ttl_s=None), "k", 1e300)  # lifted: large, but finite, is fine


def test_bytes_and_keys_bounds_are_inclusive():
    q = StoreQuota(max_bytes=100, max_keys=2)
    check_put(q, "k", 10, Usage(bytes=100, keys=2, host_bytes=0))
    with pytest.raises(QuotaExceeded, match="to 101 bytes, above its quota of 100 bytes"):
        check_put(q, "k", 11, Usage(bytes=101, keys=2, host_bytes=0))
    with pytest.raises(QuotaExceeded, match="holds 2 keys, at most 2 allowed"):
        check_put(q, "k", 1, Usage(bytes=1, keys=3, host_bytes=0))
    check_put(StoreQuota(max_bytes=None, max_keys=None), "k", 1 << 40, Usage(1 << 40, 10**9, 0))


def test_one_writer_holds_at_most_its_share_inclusive():
    q = StoreQuota(max_bytes=100, max_keys=10, writer_share=0.5)
    check_put(q, "k", 10, Usage(60, 6, 0, writer="f", writer_bytes=50, writer_keys=5))
    with pytest.raises(QuotaExceeded, match=r"the keys of function 'f' to 51 bytes .* above its share of 50 "
                       r"bytes \(writer_share 0.5 of max_bytes 100\)"):
        check_put(q, "k", 11, Usage(61, 6, 0, writer="f", writer_bytes=51, writer_keys=5))
    with pytest.raises(QuotaExceeded, match=r"function 'f' holds 5 keys .* at most 5 allowed"):
        check_put(q, "k", 1, Usage(1, 6, 0, writer="f", writer_bytes=1, writer_keys=6))
    check_put(q, "k", 99, Usage(bytes=99, keys=1, host_bytes=0))  # no writer: the totals only
    check_put(StoreQuota(max_bytes=100, writer_share=None), "k", 99, Usage(99, 1, 0, "f", 99, 1))
    # A share rounds to at least one key and one byte (it refused every PUT of a one-key store), and
    # 1.0 is no share (it rounded a huge bound down by a byte).
    check_put(StoreQuota(max_keys=1), "k", 1, Usage(1, 1, 0, "f", 1, 1))
    huge = 2**53 + 1
    check_put(StoreQuota(max_bytes=huge, writer_share=1.0), "k", huge, Usage(huge, 1, 0, "f", huge, 1))
    for bad in (0, 1.5, -0.1, True, "half"):
        with pytest.raises(ValueError, match="writer_share"):
            StoreQuota(writer_share=bad)


def test_writer_tally_counts_what_each_writer_s_keys_hold():
    tally = WriterTally()
    assert tally.usage("f", 10) == (10, 1) and tally.usage(None, 10) == (0, 0)
    tally.add("f", 10)
    tally.add("g", 7)
    tally.add(None, 99)  # no writer: nothing to count
    assert tally.usage("f", 4, replaced=("f", 10)) == (4, 1)  # overwriting its own key: not a new one
    assert tally.usage("f", 4, replaced=("g", 7)) == (14, 2)  # overwriting another's: all its own
    tally.remove_key("f")  # the key left the table; its bytes are held until freed
    assert tally.held("f") == (10, 0) and tally.usage("f", 1) == (11, 1)
    tally.release("f", 10)
    assert tally.held("f") == (0, 0) and tally.held("g") == (7, 1)
    tally.remove_key(None)
    tally.release(None, 99)


def test_host_tier_cap():
    q = StoreQuota(max_host_bytes=10)
    assert host_allows(q, 4, 6) and not host_allows(q, 5, 6)
    assert host_allows(StoreQuota(max_host_bytes=None), 1 << 50, 1 << 50)


def test_quota_rejects_bad_settings():
    with pytest.raises(ValueError, match="max_bytes"):
        StoreQuota(max_bytes=-1)
    with pytest.raises(ValueError, match="max_ttl_s"):
        StoreQuota(max_ttl_s=math.inf)


@pytest.fixture
def store_of(tmp_path):
    backend = EmulatedBackend(spec=SPEC, state_dir=tmp_path / "state")
    runtime = backend.open_runtime(0)
    allocator = StreamPoolAllocator(runtime)
    stores = []

    def make(quota: StoreQuota) -> CommStore:
        config = StoreConfig(capacity_fraction=1.0, adaptive_movement=False, quota=quota)
        store = CommStore({0: runtime}, {0: allocator}, idle={0: 16 * MiB}, config=config)
        stores.append(store)
        return store

    yield make, allocator
    for store in stores:
        store.close()
    s = runtime.create_stream()
    s.synchronize()
    s.destroy()
    deadline = time.monotonic() + 2
    while allocator.pool.used_bytes and time.monotonic() < deadline:
        time.sleep(0.005)
    assert allocator.pool.used_bytes == 0  # refused PUTs left nothing behind
    runtime.close()
    backend.close()


def _mib(n: float) -> torch.Tensor:
    return torch.zeros(int(n * MiB), dtype=torch.uint8)


def test_a_store_over_its_quota_refuses_the_put_and_keeps_the_rest(store_of):
    make, _ = store_of
    store = make(StoreQuota(max_bytes=3 * MiB, max_keys=3, max_ttl_s=600.0))
    store.put("a", _mib(1))
    store.put("b", _mib(1))
    with pytest.raises(
        QuotaExceeded, match=r"PUT 'c': 2097152 bytes would bring .* above its quota of 3145728"
    ):
        store.put("c", _mib(2))
    assert store.keys() == ["a", "b"] and sum(store.usage().values()) == 2 * MiB
    store.put("c", _mib(0.5))
    with pytest.raises(QuotaExceeded, match="holds 3 keys, at most 3 allowed"):
        store.put("d", _mib(0.01))
    store.put("a", _mib(1), overwrite=True)  # replacing a key is not a new key
    with pytest.raises(QuotaExceeded, match="ttl 1e\\+300 s"):
        store.put("e", _mib(0.01), ttl=1e300)
    store.delete("c")
    store.put("d", _mib(0.5))
    assert store.keys() == ["a", "b", "d"]


def test_host_tier_cap_keeps_data_on_the_gpu_and_refuses_what_has_no_room(store_of):
    make, _ = store_of
    # A 16 MiB GPU: 12 MiB fit on it; the host tier takes 2 MiB more, then PUTs fail clearly.
    store = make(StoreQuota(max_bytes=None, max_host_bytes=2 * MiB))
    for i in range(6):
        store.put(f"k{i}", _mib(2))
    usage = store.usage()
    assert usage[-1] <= 2 * MiB
    with pytest.raises(QuotaExceeded, match="the host tier holds"):
        for i in range(6, 12):
            store.put(f"k{i}", _mib(2))
    assert store.usage()[-1] <= 2 * MiB


def test_a_writer_over_its_share_is_refused_and_the_others_go_on(store_of):
    make, _ = store_of
    store = make(StoreQuota(max_bytes=4 * MiB, writer_share=0.5))
    store.put("f0", _mib(1), writer="f")
    store.put("f1", _mib(1), writer="f")
    with pytest.raises(QuotaExceeded, match="the keys of function 'f' to 3145728 bytes .* share of 2097152"):
        store.put("f2", _mib(1), writer="f")
    store.put("f1", _mib(0.5), writer="f", overwrite=True)  # its own key replaced: within its share
    store.put("g0", _mib(2), writer="g")  # the rest of the store is the others'
    store.delete("f0")
    store.put("f2", _mib(1), writer="f")  # a deleted key gave its share back
    assert store.keys() == ["f1", "f2", "g0"]


def test_a_writer_cannot_pass_its_share_by_reading_its_own_keys_back(store_of):
    """A consumed key left the table at once, but a lease kept its bytes in the store: a function that
    GOT each key it PUT held nothing by the tally and filled the whole store."""
    make, _ = store_of
    store = make(StoreQuota(max_bytes=4 * MiB, writer_share=0.5))
    leases = []
    store.put("f0", _mib(1), writer="f", consumers=1)
    leases.append(store.get("f0", owner="f"))  # consumed: the key is gone, the lease holds its bytes
    store.put("f1", _mib(1), writer="f", consumers=1)
    leases.append(store.get("f1", owner="f"))
    with pytest.raises(QuotaExceeded, match="above its share of 2097152"):
        store.put("f2", _mib(1), writer="f", consumers=1)
    store.put("g0", _mib(2), writer="g")  # the rest is still the others'
    for lease in leases:
        lease.release()
    store.put("f2", _mib(1), writer="f")  # freed with the leases: its share is back
