"""The store shell on an emulated node of three GPUs: transports, producer-consumer semantics,
consumption and leases, errors, and the elastic store's movement under pressure (PA, AM)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from streambox.api_proxy.device_tensor import DeviceTensor, download_tensor, upload_tensor
from streambox.comm import HOST, FunctionClient, GetTimeout, KeyExists, StoreConfig, Transport
from streambox.comm.policy import RULE_EVEN, RULE_HOST, RULE_HOST_NO_AM, RULE_READER
from streambox.device import OutOfDeviceMemory
from streambox.device.specs import MiB

from .conftest import Idle


def data(n_floats: int, seed: int = 0) -> torch.Tensor:
    return torch.arange(n_floats, dtype=torch.float32) + seed


def read(store, handle) -> torch.Tensor:
    """The handle's bytes, copied to the host through its own GPU."""
    rt = store.runtime(handle.device)
    stream = rt.create_stream()
    try:
        handle.wait(stream)
        return download_tensor(rt, handle, stream)
    finally:
        stream.destroy()


# -- transports ---------------------------------------------------------------------------------
def test_same_gpu_get_is_the_stored_address_zero_copy(make_store):
    store = make_store()
    loc = store.put("k", data(1000), device=1)
    with store.get("k", device=1) as a, store.get("k", device=1) as b:
        assert a.transport is Transport.SAME_GPU and a.address == b.address == loc.address
        a.view().fill_(7.0)  # the same memory: a write through one handle shows through the other
        assert torch.equal(b.view(), torch.full((1000,), 7.0))


def test_other_gpu_get_is_a_peer_copy_into_the_readers_gpu(make_store, runtimes):
    store = make_store(config=StoreConfig(capacity_fraction=1.0, adaptive_movement=False))
    loc = store.put("k", data(1000), device=0)
    with store.get("k", device=2) as h:
        assert h.transport is Transport.PEER and h.device == 2 and h.address != loc.address
        assert torch.equal(read(store, h), data(1000))
    peer = [r for r in runtimes[0].timeline() if r.lane == "peer"]
    assert [r.nbytes for r in peer] == [4000]
    assert store.location("k").device == 0  # AM off: no relocation


def test_rule1_remote_reader_becomes_the_home_when_more_reads_follow(make_store):
    store = make_store()
    store.put("k", data(1000), device=0, consumers=3)
    first = store.get("k", device=2)
    assert first.transport is Transport.PEER
    assert store.location("k").device == 2 and store.stats.relocations == 1
    second = store.get("k", device=2)  # now local to GPU 2: no copy
    assert second.transport is Transport.SAME_GPU and second.address == first.address
    assert store.usage()[0] == 0 and store.usage()[2] == 4000
    third = store.get("k", device=2)  # the last read
    for h in (first, second, third):
        assert torch.equal(read(store, h), data(1000))
        h.release()
    store.synchronize()
    assert store.usage() == {0: 0, 1: 0, 2: 0, HOST: 0} and store.keys() == []


def test_last_read_from_another_gpu_does_not_relocate(make_store):
    store = make_store()
    store.put("k", data(10), device=0, consumers=1)
    with store.get("k", device=1) as h:
        assert h.transport is Transport.PEER and store.stats.relocations == 0
        assert torch.equal(read(store, h), data(10))


def test_device_tensor_put_is_adopted_without_a_copy(make_store, runtimes, allocators):
    store = make_store()
    stream = runtimes[0].create_stream()
    handle = upload_tensor(runtimes[0], data(256), allocators[0].allocate, stream)
    loc = store.put("k", handle, device=0, consumers=1, stream=stream)
    assert loc.address == handle.address and loc.nbytes == 1024 and loc.dtype == "float32"
    with store.get("k", device=0) as h:
        assert h.address == handle.address and torch.equal(read(store, h), data(256))
    stream.destroy()  # the store freed the adopted bytes: the leak check in make_store proves it


def test_readers_wait_for_the_producers_stream(make_store, runtimes, allocators):
    """A device tensor PUT while its producer kernel still runs: readers on other streams (same GPU:
    through `wait`, other GPU: the store's peer copy) see the finished bytes."""
    store = make_store(config=StoreConfig(capacity_fraction=1.0, adaptive_movement=False))
    rt = runtimes[0]
    producer = rt.create_stream()
    address = allocators[0].allocate(4000, producer)
    gate = threading.Event()

    def kernel():
        gate.wait(5)
        rt.view(address, torch.float32, (1000,)).copy_(data(1000, seed=3))

    rt.launch(producer, kernel, name="produce")

    tensor = DeviceTensor(address, torch.float32, (1000,), (1,), 4000)
    store.put("k", tensor, device=0, consumers=2, stream=producer)
    same = store.get("k", device=0)
    assert same.ready is not None and not same.ready.query()
    threading.Timer(0.05, gate.set).start()
    other = store.get("k", device=1)  # blocks in the peer copy until the kernel is done
    assert torch.equal(read(store, other), data(1000, seed=3))
    assert torch.equal(read(store, same), data(1000, seed=3))
    same.release()
    other.release()
    producer.destroy()


# -- producer-consumer ----------------------------------------------------------------------------
def test_get_before_put_waits_for_the_put(make_store):
    store = make_store()
    threading.Timer(0.1, lambda: store.put("late", data(8), device=0)).start()
    started = time.monotonic()
    with store.get("late", device=0, timeout=5) as h:
        assert time.monotonic() - started >= 0.09
        assert torch.equal(read(store, h), data(8))


def test_concurrent_consumers_each_get_the_data_once_then_it_is_freed(make_store):
    store = make_store()
    readers, results, errors = 6, {}, []

    def consume(i: int) -> None:
        try:
            h = store.get("fan", device=i % 3, timeout=5, owner=f"f{i}")
            results[i] = (h.transport, read(store, h))
            h.release()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(readers)]
    for t in threads:
        t.start()
    time.sleep(0.05)  # every reader is waiting before the PUT
    store.put("fan", data(4096), device=0, consumers=readers)
    for t in threads:
        t.join(10)
    assert not errors and len(results) == readers
    assert all(torch.equal(t, data(4096)) for _, t in results.values())
    assert store.keys() == []
    with pytest.raises(GetTimeout, match="consumed by its declared consumers"):
        store.get("fan", device=0, timeout=0.05)
    store.synchronize()
    assert store.usage() == {0: 0, 1: 0, 2: 0, HOST: 0} and store.held_leases() == 0


def test_consumed_data_stays_valid_until_its_handle_is_released(make_store, allocators):
    store = make_store()
    store.put("k", data(1000), device=0, consumers=1)
    h = store.get("k", device=0)
    assert store.keys() == [] and store.usage()[0] == 4000  # out of the table, bytes still held
    assert torch.equal(read(store, h), data(1000))
    h.release()
    h.release()  # idempotent
    store.synchronize()
    assert store.usage()[0] == 0 and allocators[0].pool.used_bytes == 0


def test_release_on_a_stream_frees_after_the_readers_work(make_store, runtimes, allocators):
    store = make_store()
    rt = runtimes[0]
    store.put("k", data(1000), device=0, consumers=1)
    reader = rt.create_stream()
    h = store.get("k", device=0)
    gate, seen = threading.Event(), []
    view = h.view()
    rt.launch(reader, lambda: (gate.wait(5), seen.append(view.sum().item())), name="read")
    h.release(reader)
    time.sleep(0.05)
    assert allocators[0].pool.used_bytes > 0  # free still queued behind the reader's kernel
    gate.set()
    reader.synchronize()
    store.synchronize()
    assert seen == [float(data(1000).sum())] and allocators[0].pool.used_bytes == 0
    reader.destroy()


# -- errors -------------------------------------------------------------------------------------
def test_missing_key_times_out_naming_the_key(make_store):
    store = make_store()
    started = time.monotonic()
    with pytest.raises(GetTimeout, match="'nowhere'.*0.1 s.*never PUT") as info:
        store.get("nowhere", device=0, timeout=0.1)
    assert isinstance(info.value, TimeoutError) and info.value.key == "nowhere"
    assert 0.09 <= time.monotonic() - started < 2.0


def test_put_over_a_key_needs_overwrite(make_store):
    store = make_store()
    store.put("k", data(4), device=0)
    with pytest.raises(KeyExists, match="'k'.*overwrite=True"):
        store.put("k", data(4, seed=1), device=0)
    old = store.get("k", device=0)
    store.put("k", data(4, seed=9), device=0, overwrite=True)
    assert torch.equal(read(store, old), data(4))  # the old bytes live until their handle goes
    with store.get("k", device=0) as new:
        assert torch.equal(read(store, new), data(4, seed=9))
    old.release()


def test_bad_arguments_are_rejected(make_store):
    store = make_store()
    with pytest.raises(ValueError, match="non-empty"):
        store.put("", data(1))
    with pytest.raises(ValueError, match="consumers"):
        store.put("k", data(1), consumers=0)
    with pytest.raises(ValueError, match="ttl"):
        store.put("k", data(1), ttl=-1)
    with pytest.raises(TypeError, match="device tensor"):
        store.put("k", object())
    with pytest.raises(Exception, match="no GPU 7"):
        store.get("k", device=7, timeout=0.01)


def test_delete_frees_and_later_gets_say_so(make_store):
    store = make_store()
    store.put("k", data(4), device=0)
    assert store.delete("k") and not store.delete("k")
    with pytest.raises(GetTimeout, match="it was deleted"):
        store.get("k", device=0, timeout=0.01)
    store.synchronize()
    assert store.usage()[0] == 0


# -- consumers that die ---------------------------------------------------------------------------
def test_ttl_frees_data_whose_consumer_never_came(make_store):
    store = make_store()
    now = store.clock()
    store.put("k", data(1000), device=0, consumers=2, ttl=5.0)
    store.get("k", device=0).release()  # one of two consumers came
    assert store.expire(now + 4.9) == ([], 0)
    assert store.expire(now + 10) == (["k"], 0)
    store.synchronize()
    assert store.usage()[0] == 0
    with pytest.raises(GetTimeout, match=r"expired \(TTL\)"):
        store.get("k", device=0, timeout=0.01)


def test_expiry_skips_its_scan_until_the_earliest_deadline_and_never_misses_one(make_store):
    """The ticker's `expire` scans the keys only once something can be due (its deadline hint): a key
    put later with an earlier TTL, and the later keys after a scan, still expire on time."""
    store = make_store()
    now = store.clock()
    store.put("late", data(100), device=0, consumers=1, ttl=10.0)
    store.put("early", data(100), device=0, consumers=1, ttl=2.0)
    assert store.expire(now + 1.0) == ([], 0)
    assert store.expire(now + 3.0) == (["early"], 0)  # the scan recomputes the hint: "late" at +10
    store.put("sooner", data(100), device=0, consumers=1, ttl=1.0)  # put at about `now`: due by +3.5
    assert store.expire(now + 3.5) == (["sooner"], 0)
    assert store.expire(now + 9.0) == ([], 0)
    assert store.expire(now + 10.5) == (["late"], 0)


def test_a_dead_consumers_handles_are_released_with_its_owner(make_store, runtimes):
    store = make_store()
    stream = runtimes[1].create_stream()
    fn = FunctionClient(store, device=1, owner="fn-7", stream=stream)
    store.put("a", data(100), device=1, consumers=1)
    store.put("b", data(100), device=0, consumers=1)
    ha, hb = fn.get("a"), fn.get("b")
    assert (ha.transport, hb.transport) == (Transport.SAME_GPU, Transport.PEER)
    assert store.held_leases() == 2
    assert fn.close() == 2  # the proxy saw fn-7 die
    assert ha.released and hb.released and store.held_leases() == 0
    store.synchronize()
    assert store.usage() == {0: 0, 1: 0, 2: 0, HOST: 0}
    stream.destroy()


def test_leases_past_their_ttl_are_force_released(make_store):
    store = make_store(config=StoreConfig(capacity_fraction=1.0, lease_ttl_s=2.0))
    store.put("k", data(10), device=0, consumers=1)
    h = store.get("k", device=0)
    assert store.expire(store.clock() + 1.0) == ([], 0)
    assert store.expire(store.clock() + 3.0) == ([], 1)
    assert h.released
    with pytest.raises(Exception, match="released"):
        h.view()


def test_function_client_put_get_delete(make_store, runtimes):
    store = make_store()
    s0, s1 = runtimes[0].create_stream(), runtimes[1].create_stream()
    producer = FunctionClient(store, device=0, owner="p", stream=s0)
    consumer = FunctionClient(store, device=1, owner="c", stream=s1)
    assert producer.put("x", data(64), consumers=1).device == 0
    h = consumer.get("x", timeout=1)
    assert torch.equal(read(store, h), data(64))
    consumer.release(h)
    assert not consumer.delete("x")  # already consumed
    s0.destroy()
    s1.destroy()


# -- elastic store: pressure awareness and adaptive movement ---------------------------------------
def test_capacity_comes_from_the_predicted_idle_memory_of_the_window(make_store):
    idle = Idle({0: 10 * MiB, 1: 4 * MiB, 2: -1})
    store = make_store(idle=idle, config=StoreConfig(capacity_fraction=0.5, window_s=0.02))
    assert store.capacities(now=7.0) == {0: 5 * MiB, 1: 2 * MiB, 2: 0}
    assert (0, 7.0, 0.02) in idle.calls
    off = make_store(idle=idle, config=StoreConfig(pressure_aware=False, static_capacity=3 * MiB))
    assert off.capacities() == {0: 3 * MiB, 1: 3 * MiB, 2: 3 * MiB}


def test_put_lands_where_the_policy_places_it(make_store):
    idle = Idle({0: 1 * MiB, 1: 8 * MiB, 2: 4 * MiB})
    store = make_store(idle=idle)
    assert store.put("a", torch.zeros(2 * MiB, dtype=torch.uint8), device=0).device == 1  # home full
    idle.values = {0: 0, 1: 0, 2: 0}
    assert store.put("b", torch.zeros(MiB, dtype=torch.uint8), device=0).device == HOST
    with store.get("b", device=2) as h:
        assert h.transport is Transport.HOST


def _fill(store, device: int, sizes_mib: dict[str, int]) -> None:
    for i, (key, mib) in enumerate(sizes_mib.items()):
        store.put(key, torch.full((mib * MiB,), i + 1, dtype=torch.uint8), device=device)


def _check_contents(store, sizes_mib: dict[str, int], reader: int = 0) -> None:
    for i, key in enumerate(sizes_mib):
        with store.get(key, device=reader) as h:
            got = read(store, h)
            assert got.numel() == sizes_mib[key] * MiB and bool((got == i + 1).all()), key


def test_pa_moves_the_largest_data_to_the_least_pressured_gpu_before_it_is_needed(make_store):
    idle = Idle({0: 32 * MiB, 1: 16 * MiB, 2: 32 * MiB})
    store = make_store(idle=idle)
    sizes = {"s": 1, "l": 4, "m": 2}
    _fill(store, 0, sizes)
    store.tick()
    assert store.stats.moves == {}  # within capacity: nothing moves
    idle.values[0] = 3 * MiB  # a function will need GPU 0's memory within the window
    store.tick()
    # 7 MiB held, 3 allowed: "l" (4 MiB) leaves, to GPU 2 (4/32) rather than GPU 1 (4/16).
    assert {k: store.location(k).device for k in sizes} == {"s": 0, "l": 2, "m": 0}
    assert store.stats.moves == {RULE_EVEN: 1} and store.usage()[0] == 3 * MiB
    assert store.stats.moved_to == {"gpu2": {"count": 1, "bytes": 4 * MiB}}
    _check_contents(store, sizes)
    # _check_contents read "l" from GPU 0: one GET served by a peer copy from GPU 2.
    assert store.stats.copied_from == {"gpu2": {"count": 1, "bytes": 4 * MiB}}
    snap = store.snapshot()
    assert snap["gpus"] == [0, 1, 2] and snap["moved_to"] == store.stats.moved_to
    assert snap["held_bytes"] == {"host": 0, "gpu0": 3 * MiB, "gpu1": 0, "gpu2": 4 * MiB}


def test_rule1_data_read_from_another_gpu_moves_to_that_reader(make_store):
    idle = Idle({0: 32 * MiB, 1: 32 * MiB, 2: 0})
    store = make_store(idle=idle)
    store.put("k", torch.ones(4 * MiB, dtype=torch.uint8), device=0)
    store.get("k", device=2).release()  # GPU 2 has no room now: a private copy, no relocation
    assert store.location("k").device == 0 and store.stats.relocations == 0
    idle.values = {0: 0, 1: 32 * MiB, 2: 16 * MiB}  # GPU 1 is emptier, but GPU 2 read it
    store.tick()
    assert store.location("k").device == 2 and store.stats.moves == {RULE_READER: 1}


def test_without_am_data_goes_to_host(make_store):
    idle = Idle({0: 32 * MiB, 1: 32 * MiB, 2: 32 * MiB})
    store = make_store(idle=idle, config=StoreConfig(capacity_fraction=1.0, adaptive_movement=False))
    sizes = {"a": 2, "b": 3}
    _fill(store, 0, sizes)
    idle.values[0] = 0
    store.tick()
    assert {k: store.location(k).device for k in sizes} == {"a": HOST, "b": HOST}
    assert store.stats.moves == {RULE_HOST_NO_AM: 2} and store.usage()[HOST] == 5 * MiB
    assert store.stats.moved_to == {"host": {"count": 2, "bytes": 5 * MiB}}
    with store.get("b", device=0) as h:
        assert h.transport is Transport.HOST
    _check_contents(store, sizes)


def test_every_gpu_full_means_host(make_store):
    idle = Idle({0: 32 * MiB, 1: 1 * MiB, 2: 1 * MiB})
    store = make_store(idle=idle)
    _fill(store, 0, {"a": 2})
    idle.values[0] = 0
    store.tick()
    assert store.location("a").device == HOST and store.stats.moves == {RULE_HOST: 1}


def test_held_data_is_not_moved(make_store):
    idle = Idle({0: 32 * MiB, 1: 32 * MiB, 2: 32 * MiB})
    store = make_store(idle=idle)
    _fill(store, 0, {"a": 2})
    h = store.get("a", device=0)
    idle.values[0] = 0
    store.tick()
    assert store.location("a").device == 0  # its reader holds the address
    h.release()
    store.tick()
    assert store.location("a").device != 0


def test_without_pa_nothing_moves_until_the_pool_reclaims(make_store):
    idle = Idle({0: 0, 1: 0, 2: 0})  # pressure everywhere, but the store does not look
    store = make_store(idle=idle, config=StoreConfig(pressure_aware=False))
    sizes = {"a": 1, "b": 3, "c": 2}
    _fill(store, 0, sizes)
    store.tick()
    assert store.stats.moves == {} and all(store.location(k).device == 0 for k in sizes)
    assert store.reclaim(0, 2 * MiB) == 3 * MiB  # largest first: "b" covers 2 MiB
    assert store.location("b").device == 1 and store.stats.reclaims == 1  # AM: GPU 1 (tie -> index)
    _check_contents(store, sizes)


def test_reclaim_when_a_function_runs_out_of_memory(make_store, runtimes, allocators):
    """The memory pool's path: an allocation fails, the store gives bytes back, the retry succeeds."""
    store = make_store(config=StoreConfig(pressure_aware=False, adaptive_movement=False))
    for i in range(6):
        store.put(f"k{i}", torch.full((8 * MiB,), i, dtype=torch.uint8), device=0)
    want = 24 * MiB
    with pytest.raises(OutOfDeviceMemory):
        runtimes[0].mem_alloc(want)
    freed = store.reclaim(0, want)
    assert freed >= want
    store.synchronize()
    allocators[0].pool.trim_to(0)  # the pool gives its cached blocks back to the device
    address = runtimes[0].mem_alloc(want)
    runtimes[0].mem_free(address)
    assert store.usage()[HOST] == freed
    for i in range(6):
        with store.get(f"k{i}", device=1) as h:
            assert bool((read(store, h) == i).all())


def test_moved_data_reads_back_intact_under_concurrent_gets(make_store):
    """The ticker moves data while readers GET it: every read sees the right bytes."""
    idle = Idle({0: 64 * MiB, 1: 64 * MiB, 2: 64 * MiB})
    store = make_store(idle=idle, config=StoreConfig(capacity_fraction=1.0, tick_s=0.002)).start()
    keys = [f"k{i}" for i in range(8)]
    for i, key in enumerate(keys):
        store.put(key, torch.full((MiB,), i, dtype=torch.uint8), device=0)
    stop, errors = threading.Event(), []

    def reader(dev: int) -> None:
        while not stop.is_set():
            for i, key in enumerate(keys):
                try:
                    with store.get(key, device=dev, timeout=2) as h:
                        if not bool((read(store, h) == i).all()):
                            errors.append(key)
                except Exception as exc:  # noqa: BLE001
                    errors.append(exc)

    threads = [threading.Thread(target=reader, args=(d,)) for d in (0, 1)]
    for t in threads:
        t.start()
    for level in (2, 0, 5, 1, 8):
        idle.values = {0: level * MiB, 1: (8 - level) * MiB, 2: 4 * MiB}
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(10)
    assert not errors, errors[:3]
    assert sum(store.stats.moves.values()) > 0


def test_data_on_host_moves_back_to_its_reader_when_more_reads_follow(make_store):
    idle = Idle({0: 0, 1: 0, 2: 0})
    store = make_store(idle=idle)
    assert store.put("k", data(1000), device=0, consumers=3).device == HOST  # every GPU full
    idle.values = {0: 0, 1: 8 * MiB, 2: 0}
    first = store.get("k", device=1)
    assert first.transport is Transport.HOST and store.location("k").device == 1  # rule 1
    with store.get("k", device=1) as second:
        assert second.transport is Transport.SAME_GPU and second.address == first.address
    first.release()
    assert store.usage()[HOST] == 0
    with store.get("k", device=1) as last:
        assert torch.equal(read(store, last), data(1000))


def test_watch_calls_back_once_after_the_keys_put_at_once_if_present_and_can_be_cancelled(make_store):
    store = make_store()
    seen: list[str] = []
    store.watch("w/a", lambda: seen.append("a"))
    cancel = store.watch("w/b", lambda: seen.append("b"))
    cancel()
    store.put("w/b", torch.ones(4), device=0)
    assert seen == []  # cancelled before the PUT
    store.put("w/a", torch.ones(4), device=0)
    assert seen == ["a"]
    store.delete("w/a")
    store.put("w/a", torch.ones(4), device=0)
    assert seen == ["a"]  # one-shot
    store.watch("w/a", lambda: seen.append("again"))  # present now: called at once
    assert seen == ["a", "again"]


def test_an_idle_ticker_wakes_for_data_that_arrives(make_store):
    """With nothing stored the ticker waits its idle period (here far longer than the test); a PUT
    wakes it, so a short TTL is still enforced by the background ticker within a few ticks."""
    store = make_store(config=StoreConfig(capacity_fraction=1.0, tick_s=0.005, idle_tick_s=60.0)).start()
    time.sleep(0.05)  # the ticker's first wait began with an empty store: the idle period
    store.put("k", data(100), device=0, consumers=1, ttl=0.05)
    deadline = time.monotonic() + 5
    while store.keys() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store.keys() == []  # expired by the ticker, not 60 s later


def test_a_busy_ticker_keeps_its_period_whatever_the_puts(make_store, monkeypatch):
    """Once the store holds data the ticker runs every `tick_s`; PUTs and GETs do not wake it for a
    round each (under load that was hundreds of idle-memory predictions a second)."""
    # The store holds "kept" throughout, so the ticker never goes idle (an emptied store's ticker
    # idles, and the next PUT rightly wakes it: on a loaded host the loop below empties it between
    # rounds). A 5 s period leaves no room for a second timed round within the test.
    store = make_store(config=StoreConfig(capacity_fraction=1.0, tick_s=5.0, idle_tick_s=60.0))
    rounds = []
    tick = store.tick
    monkeypatch.setattr(store, "tick", lambda now=None: (rounds.append(1), tick(now)))
    store.start()
    time.sleep(0.05)  # idle period
    store.put("kept", data(100), device=0, consumers=1)  # wakes the idle ticker: one round
    deadline = time.monotonic() + 5.0
    while not rounds and time.monotonic() < deadline:
        time.sleep(0.01)
    for i in range(40):
        store.put(f"k{i}", data(100), device=0, consumers=1)
        store.get(f"k{i}", device=0).release()
    time.sleep(0.2)
    assert len(rounds) == 1  # the first PUT's wake-up, not one per call (the old code: one per PUT and GET)


def test_idle_tick_must_not_be_shorter_than_the_tick():
    with pytest.raises(ValueError, match="idle_tick_s"):
        StoreConfig(tick_s=0.01, idle_tick_s=0.001)


def test_the_idle_tick_defaults_to_no_less_than_the_tick():
    assert StoreConfig().idle_period_s == 0.1
    assert StoreConfig(tick_s=0.25).idle_period_s == 0.25  # a slowed ticker (bench_comm's dilation)
    assert StoreConfig(tick_s=0.01, idle_tick_s=2.0).idle_period_s == 2.0
