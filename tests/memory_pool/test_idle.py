"""Idle memory for the communication store from the pool's demand model: the pure rule (tables and
hypothesis) and the shell over a real pool, a position board and the real scaler."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from streambox.memory_pool.idle import FunctionNeed, PoolIdleMemory, function_needs, predict_idle_bytes
from streambox.memory_pool.pool import DeviceMemoryPool
from streambox.memory_pool.scaler import PositionBoard, ResilientScaler
from streambox.memory_pool.scaling import FunctionPosition, ModelProfile, ScalingConfig

MiB = 1 << 20
# kernel live bytes and run times: 1 MiB for 50 ms, 3 MiB for 50 ms, 20 MiB for 50 ms
F = ModelProfile.from_pairs("f", 1, [(1 * MiB, 0.05), (3 * MiB, 0.05), (20 * MiB, 0.05)])
WINDOW = 0.02


@pytest.mark.parametrize(
    ("free", "reserved", "demand", "store", "functions", "idle"),
    [
        # nothing runs: everything the pool has or could get
        (40, 24, 0, 0, [], 64),
        # weights 10 outside the profiles; f holds 2 and needs 5 in the window
        (40, 24, 12, 0, [FunctionNeed("f", 2, 5)], 64 - 10 - 5),
        # the store's 8 bytes in the pool are not subtracted
        (40, 24, 20, 8, [FunctionNeed("f", 2, 5)], 64 - 10 - 5),
        # a function holding more than its profile predicts counts what it holds
        (40, 24, 12, 0, [FunctionNeed("f", 6, 5)], 64 - 6 - 6),
        # an unprofiled function counts what it holds
        (40, 24, 12, 0, [FunctionNeed("g", 4)], 64 - 8 - 4),
        # predicted demand beyond the device: none idle, never negative
        (4, 4, 0, 0, [FunctionNeed("f", 0, 100)], 0),
        # store bytes beyond the demand (moved out meanwhile): other holders do not go negative
        (40, 24, 5, 8, [], 64),
    ],
)
def test_predict_idle_bytes_table(free, reserved, demand, store, functions, idle) -> None:
    assert predict_idle_bytes(free, reserved, demand, store, functions) == idle


def test_predict_idle_bytes_rejects_negative_counts() -> None:
    with pytest.raises(ValueError, match="negative"):
        predict_idle_bytes(-1, 0, 0, 0, [])


sizes = st.integers(0, 1 << 40)
needs = st.lists(st.builds(FunctionNeed, st.integers(), sizes, st.none() | sizes), max_size=6)


@given(sizes, sizes, sizes, sizes, needs, sizes)
def test_predict_idle_bytes_invariants(free, reserved, demand, store, functions, shift) -> None:
    idle = predict_idle_bytes(free, reserved, demand, store, functions)
    assert 0 <= idle <= free + reserved
    # resizing the pool moves bytes between device-free and reserved: the prediction does not move
    moved = min(shift, free)
    assert predict_idle_bytes(free - moved, reserved + moved, demand, store, functions) == idle
    # more predicted demand never makes more idle memory
    more = [*functions, FunctionNeed("extra", 0, shift)]
    assert predict_idle_bytes(free, reserved, demand, store, more) <= idle
    # the store's bytes are not subtracted: a PUT into the pool leaves the prediction as it was...
    assert predict_idle_bytes(free, reserved, demand + shift, store + shift, functions) == idle
    # ...and bytes of the pool's demand attributed to the store are idle, at most themselves
    assert idle <= predict_idle_bytes(free, reserved, demand, store + shift, functions) <= idle + shift


def test_function_needs_use_algorithm_1_window() -> None:
    board = [
        (FunctionPosition("a", "f", 1, 0, 0.03), 1 * MiB),  # kernel 1 starts at +40 ms: outside
        (FunctionPosition("b", "f", 1, 1, 0.0), 3 * MiB),  # at 40 ms kernel 2 starts at +10 ms: inside
        (FunctionPosition("c", "g", 1, 0, 0.0), 7 * MiB),  # no profile: what it holds
    ]
    got = function_needs(0.04, board, {F.key: F}, WINDOW)
    assert got == [
        FunctionNeed("a", 1 * MiB, 1 * MiB),
        FunctionNeed("b", 3 * MiB, 20 * MiB),
        FunctionNeed("c", 7 * MiB, None),
    ]


def test_pool_idle_memory_follows_positions_not_pool_size(runtime) -> None:
    pool = DeviceMemoryPool(runtime)
    board = PositionBoard()
    scaler = ResilientScaler(pool, board, [F], ScalingConfig(t_interval_s=WINDOW))
    idle = PoolIdleMemory(pool, board, scaler)
    stream = runtime.create_stream()
    weights = pool.allocate(10 * MiB, stream)
    held = pool.allocate(1 * MiB, stream)
    board.update("f#1", "f", 1, 0, 0.0, held_bytes=1 * MiB)
    assert idle(0, 0.0, WINDOW) == 64 * MiB - 10 * MiB - 1 * MiB
    scaler.step(0.0)  # the real scaler resizes the pool: the prediction stays
    assert idle(0, 0.0, WINDOW) == 64 * MiB - 10 * MiB - 1 * MiB
    board.update("f#1", "f", 1, 1, 0.05, held_bytes=1 * MiB)  # at 90 ms kernel 2 starts in 10 ms
    assert idle(0, 0.09, WINDOW) == 64 * MiB - 10 * MiB - 20 * MiB
    store = pool.allocate(4 * MiB, stream)  # bytes of a store that allocates from this pool
    assert idle(0, 0.09, WINDOW) == 64 * MiB - 10 * MiB - 20 * MiB - 4 * MiB
    idle.store_bytes = lambda: 4 * MiB
    assert idle(0, 0.09, WINDOW) == 64 * MiB - 10 * MiB - 20 * MiB
    assert PoolIdleMemory(pool, board)(0, 0.09, WINDOW) == 64 * MiB - 10 * MiB - 1 * MiB - 4 * MiB
    pool.free_many([weights, held, store], stream)
    stream.synchronize()
    stream.destroy()
    pool.close()
