"""Fixtures for the communication store: an emulated node of three small GPUs with the V100 link
model, stream-ordered pool allocators, and a store factory that checks nothing leaks."""

from __future__ import annotations

import threading
import time

import pytest

from streambox.api_proxy.executor import StreamPoolAllocator
from streambox.comm import CommStore, StoreConfig
from streambox.device.emulated import EmulatedBackend
from streambox.device.specs import V100_16GB, DeviceSpec, MiB

GPUS = 3

SPEC: DeviceSpec = V100_16GB.with_overrides(
    name="test-gpu-64mib", total_memory=64 * MiB, context_create_s=0.0, context_memory=0
)


@pytest.fixture
def backend(tmp_path):
    be = EmulatedBackend(spec=SPEC, count=GPUS, state_dir=tmp_path / "state")
    yield be
    be.close()


@pytest.fixture
def runtimes(backend):
    return {i: backend.open_runtime(i) for i in range(GPUS)}


@pytest.fixture
def allocators(runtimes):
    return {i: StreamPoolAllocator(rt) for i, rt in runtimes.items()}


class Idle:
    """A settable idle-memory prediction per GPU (what the memory pool's demand model will give)."""

    def __init__(self, values: dict[int, float]) -> None:
        self.values = dict(values)
        self.calls: list[tuple[int, float, float]] = []

    def __call__(self, gpu: int, now: float, window: float) -> float:
        self.calls.append((gpu, now, window))
        return self.values[gpu]


@pytest.fixture
def make_store(runtimes, allocators):
    """`make_store(idle=..., config=..., **kw)`; at teardown every store is closed and every pool
    byte it took must be back."""
    stores: list[CommStore] = []

    def make(**kw) -> CommStore:
        kw.setdefault("idle", {i: 32 * MiB for i in runtimes})
        kw.setdefault("config", StoreConfig(capacity_fraction=1.0))
        store = CommStore(runtimes, allocators, **kw)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()
    for i, rt in runtimes.items():
        s = rt.create_stream()
        s.synchronize()  # frees are stream-ordered: let the pools reach them
        s.destroy()
        deadline = time.monotonic() + 2
        while allocators[i].pool.used_bytes and time.monotonic() < deadline:
            time.sleep(0.005)
        assert allocators[i].pool.used_bytes == 0, f"GPU {i}: {allocators[i].pool.used_bytes} bytes leaked"


def _our_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("streambox-comm-")}


@pytest.fixture(autouse=True)
def no_leftover_threads():
    before = _our_threads()
    yield
    deadline = time.monotonic() + 5
    while (left := _our_threads() - before) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not left, f"threads left running: {sorted(t.name for t in left)}"
