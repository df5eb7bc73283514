"""The store over the real memory pool: capacity from the pool's demand model (resilient scaling's
predictor over the store's window), pressure-aware movement on and off, and frees made safe before
the store destroys its streams."""

from __future__ import annotations

import threading

import pytest
import torch

from streambox.comm import CommStore, StoreConfig
from streambox.memory_pool.idle import PoolIdleMemory
from streambox.memory_pool.pool import DeviceMemoryPool
from streambox.memory_pool.scaler import PositionBoard, ResilientScaler
from streambox.memory_pool.scaling import ModelProfile, ScalingConfig

MiB = 1 << 20
WINDOW = 0.02
# a function's plan: 1 MiB for 50 ms, 3 MiB for 50 ms, then a 52 MiB kernel (of a 64 MiB GPU)
G = ModelProfile.from_pairs("g", 1, [(1 * MiB, 0.05), (3 * MiB, 0.05), (52 * MiB, 0.05)])


@pytest.fixture
def pools(runtimes):
    made = {g: DeviceMemoryPool(runtimes[g]) for g in (0, 1)}
    yield made
    for pool in made.values():
        pool.close()


@pytest.mark.parametrize("pa", [True, False], ids=["PA", "no-PA"])
def test_capacity_shrinks_with_predicted_demand_and_pa_moves_data_out(runtimes, pools, pa):
    now = [0.0]  # virtual time, shared by the scaler, the board's positions and the store

    def clock() -> float:
        return now[0]

    boards = {g: PositionBoard() for g in pools}
    scaler = ResilientScaler(pools[0], boards[0], [G], ScalingConfig(t_interval_s=WINDOW), clock=clock)
    idle = {0: PoolIdleMemory(pools[0], boards[0], scaler), 1: PoolIdleMemory(pools[1], boards[1])}
    config = StoreConfig(pressure_aware=pa, adaptive_movement=True, capacity_fraction=0.5, window_s=WINDOW)
    store = CommStore({g: runtimes[g] for g in pools}, pools, idle=idle, config=config, clock=clock)
    for g, model in idle.items():
        model.store_bytes = lambda g=g: store.usage()[g]
    fn_stream = runtimes[0].create_stream()
    held = pools[0].allocate(1 * MiB, fn_stream)  # the running function's kernel 0
    boards[0].update("g#1", "g", 1, 0, 0.0, held_bytes=1 * MiB)
    try:
        assert store.put("x", torch.ones(8 * MiB, dtype=torch.uint8), device=0).device == 0
        before = store.capacities()[0]
        # at 90 ms the function is in kernel 1 (since 50 ms): its 52 MiB kernel starts within the window
        now[0] = 0.09
        boards[0].update("g#1", "g", 1, 1, 0.05, held_bytes=1 * MiB)
        scaler.step()  # the real scaler grows the pool for it: the store's prediction does not move
        assert pools[0].reserved_bytes >= 52 * MiB
        after = store.capacities()[0]
        if pa:
            assert before == (64 * MiB - 1 * MiB) // 2  # 8 MiB of the store's own are not subtracted
            assert after == (64 * MiB - 52 * MiB) // 2 < 8 * MiB
        else:
            assert before == after == config.static_capacity
        store.tick()
        if pa:  # moved out ahead of the demand, to the neighbour GPU (AM), largest first
            assert store.location("x").device == 1
            assert store.stats.move_count == {"pressure->gpu": 1}
            assert store.usage()[0] == 0
        else:  # without PA nothing watches the prediction: data moves only on a reclaim
            assert store.location("x").device == 0
            assert store.stats.move_count == {}
        with store.get("x", device=0) as h:
            out = torch.empty(8 * MiB, dtype=torch.uint8)
            s = runtimes[0].create_stream()
            h.wait(s)
            runtimes[0].copy_dtoh_async(out, h.address, h.nbytes, s)
            s.synchronize()
            s.destroy()
        assert bool((out == 1).all())
    finally:
        store.close()
        pools[0].free(held, fn_stream)
        pools[0].retire_stream(fn_stream)
        fn_stream.destroy()


def test_close_with_pending_frees_leaves_no_block_on_a_destroyed_stream(runtimes, pools):
    pool = pools[0]
    config = StoreConfig(capacity_fraction=1.0)
    store = CommStore({0: runtimes[0]}, {0: pool}, idle={0: 32 * MiB}, config=config)
    store_streams = [store._copy_streams[0], store._free_streams[0]]
    for key in "abc":
        store.put(key, torch.full((MiB,), ord(key), dtype=torch.uint8), device=0)
    reader = runtimes[0].create_stream()
    opened = threading.Event()
    runtimes[0].launch(reader, lambda: opened.wait(10), name="gate")  # the reader is still busy
    handle = store.get("a", device=0)
    handle.release(reader)  # stream-ordered: after the gate
    assert store.delete("a") and store.delete("b")  # a's free waits for the reader; c stays stored
    assert store._free_streams[0] in pool.tracked_streams()  # a's block is pending on the free stream
    threading.Timer(0.05, opened.set).start()
    reserved, grows = pool.reserved_bytes, pool.counters.grows
    store.close()
    assert not set(pool.tracked_streams()) & set(store_streams)
    assert pool.demand_bytes == 0 and pool.stats().pending_free_bytes == 0
    pool.collect()  # fences every tracked stream: none of them is destroyed
    again = [pool.allocate(MiB, reader) for _ in range(3)]  # the store's bytes, reused as they are
    assert (pool.reserved_bytes, pool.counters.grows) == (reserved, grows)
    pool.free_many(again, reader)
    assert pool.retire_stream(reader)
    reader.destroy()
