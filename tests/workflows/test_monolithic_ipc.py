"""Astraea's CUDA-IPC data path (`workflows.monolithic_ipc`): a producer's runtime keeps the data,
a consumer's runtime gets a private copy of the real bytes, and the producer frees it when the key
is retired (last consumer, DELETE, end of request)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from streambox.api_proxy.device_tensor import download_tensor, upload_tensor
from streambox.api_proxy.executor import StreamPoolAllocator
from streambox.comm.errors import GetTimeout
from streambox.device.emulated import EmulatedBackend
from streambox.device.specs import V100_16GB
from streambox.workflows.local import StoreError
from streambox.workflows.monolithic_ipc import HandleRegistry, IpcHandleStore


class _Side:
    """One instance's runtime, allocator, stream and store (producer or consumer)."""

    def __init__(self, backend: EmulatedBackend, registry: HandleRegistry) -> None:
        self.runtime = backend.open_runtime(0)
        self.allocator = StreamPoolAllocator(self.runtime)
        self.stream = self.runtime.create_stream()
        self.store = IpcHandleStore(registry, "wf", self.runtime, self.allocator)

    def close(self) -> None:
        self.store.close()
        self.stream.destroy()
        self.runtime.close()


@pytest.fixture(params=["functional", "timed"])
def sides(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[_Side, _Side]]:
    spec = V100_16GB.with_overrides(context_create_s=0.0, context_memory=0)
    backend = EmulatedBackend(spec=spec, state_dir=tmp_path / "state", timeline=False, mode=request.param)
    registry = HandleRegistry.create(tmp_path / "handles")
    producer, consumer = _Side(backend, registry), _Side(backend, registry)
    yield producer, consumer
    consumer.close()
    producer.close()
    backend.close()


def _put(side: _Side, key: str, x: torch.Tensor, request: str = "r1", consumers: int | None = None) -> None:
    handle = upload_tensor(side.runtime, x, side.allocator.allocate, side.stream)
    side.store.put(key, handle, consumers=consumers, stream=side.stream, owner=request)


def test_the_consumer_copies_the_producers_bytes_and_the_producer_frees_them(
    sides: tuple[_Side, _Side],
) -> None:
    producer, consumer = sides
    timed = producer.runtime.timed
    x = torch.arange(1000, dtype=torch.float32).reshape(10, 100)
    before = producer.runtime.allocated_bytes()
    _put(producer, "wf/r1/a", x, consumers=2)
    assert producer.store.cached_bytes == x.nbytes  # held in the producer's own device memory
    assert producer.runtime.allocated_bytes() > before
    for n in (1, 2):
        got, last, copy, _ = consumer.store.get("wf/r1/a", timeout=1.0, stream=consumer.stream)
        assert last == (n == 2) and copy and got.shape == (10, 100) and got.dtype == torch.float32
        if not timed:  # functional mode: the real bytes arrived in the consumer's runtime
            assert torch.equal(download_tensor(consumer.runtime, got, consumer.stream).view(10, 100), x)
        consumer.allocator.free(got.address, consumer.stream)
    assert consumer.store.opened == 2 and producer.store.exported == 1
    assert producer.store.reap() == 1 and producer.store.cached_bytes == 0  # the last consumer retired it
    assert producer.store.cached_peak_bytes == x.nbytes
    with pytest.raises(GetTimeout):
        consumer.store.get("wf/r1/a", timeout=0.02, stream=consumer.stream)


def test_refusals_and_the_end_of_a_request(sides: tuple[_Side, _Side]) -> None:
    producer, consumer = sides
    x = torch.ones(64, dtype=torch.uint8)
    _put(producer, "wf/r1/kept", x)  # no declared consumers: kept until deleted or the request ends
    with pytest.raises(StoreError, match="already stored"):
        _put(producer, "wf/r1/kept", x)
    got = consumer.store.get("wf/r1/kept", timeout=1.0, stream=consumer.stream)
    assert not got.consumed and got.copy
    consumer.allocator.free(got.tensor.address, consumer.stream)
    _put(producer, "wf/r1/gone", x)
    assert consumer.store.delete("wf/r1/gone") is True
    assert consumer.store.delete("wf/r1/gone") is False  # ctx.delete turns this into "no such key"
    producer.store.registry.end_request("wf", "r1")
    assert producer.store.reap() == 2 and producer.store.cached_bytes == 0
    with pytest.raises(StoreError, match="request r1 has ended"):
        _put(producer, "wf/r1/late", x)
    registry = producer.store.registry
    assert registry.forget_ended(60.0) == 0 and registry.forget_ended(-1.0) == 1  # markers age out


def test_a_get_whose_producer_is_gone_says_so(sides: tuple[_Side, _Side]) -> None:
    producer, consumer = sides
    if producer.runtime.timed:
        pytest.skip("timed mode mirrors nothing: the producer's data is phantom")
    _put(producer, "wf/r1/orphan", torch.ones(8))
    segment = producer.store._exported["wf/r1/orphan"].segment
    assert segment is not None
    segment.unlink()  # what the producer's exit leaves: no segment behind the handle
    with pytest.raises(StoreError, match=r"its producer \(pid \d+\) is gone"):
        consumer.store.get("wf/r1/orphan", timeout=1.0, stream=consumer.stream)


def test_handlers_of_one_batched_message_put_and_reap_on_threads_without_losing_a_key(
    sides: tuple[_Side, _Side],
) -> None:
    """A batched message runs its members' handlers on threads of one instance: their PUTs (each
    reaping retired keys first) and a consumer retiring keys meanwhile share the producer's store."""
    import threading

    producer, consumer = sides
    threads, per_thread = 4, 15
    errors: list[BaseException] = []
    x = torch.ones(256, dtype=torch.float32)

    def produce(t: int) -> None:
        stream = producer.runtime.create_stream()
        try:
            for i in range(per_thread):
                handle = upload_tensor(producer.runtime, x, producer.allocator.allocate, stream)
                producer.store.put(f"wf/r1/t{t}-{i}", handle, consumers=1, stream=stream, owner="r1")
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)
        finally:
            stream.synchronize()
            stream.destroy()

    def consume() -> None:
        try:
            for t in range(threads):
                for i in range(per_thread):
                    key = f"wf/r1/t{t}-{i}"
                    got, last, _, _ = consumer.store.get(key, timeout=10.0, stream=consumer.stream)
                    assert last
                    consumer.allocator.free(got.address, consumer.stream)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    workers = [threading.Thread(target=produce, args=(t,)) for t in range(threads)]
    workers.append(threading.Thread(target=consume))
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert errors == []
    assert producer.store.exported == threads * per_thread and consumer.store.opened == threads * per_thread
    producer.store.reap()
    assert producer.store.cached_bytes == 0  # every retired key freed exactly once
