"""Every store takes the one `comm.store_protocol.KeyStore` calls: the proxy's (`CommStore`,
`IpcStore`) and the function-side ones (run-local's `LocalStore`, INFless's `RedisStore`, Astraea's
`IpcHandleStore`). Run-local's store is driven through exactly those calls here, end to end on the
emulated device."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from streambox.api_proxy.device_tensor import download_tensor, upload_tensor
from streambox.api_proxy.executor import StreamPoolAllocator
from streambox.comm.errors import GetTimeout
from streambox.comm.ipc_store import IpcStore
from streambox.comm.store import CommStore
from streambox.comm.store_protocol import KeyStore, Store
from streambox.device.emulated import EmulatedBackend
from streambox.device.specs import V100_16GB
from streambox.workflows.local import LocalStore, StoreError
from streambox.workflows.monolithic_instance import RedisStore
from streambox.workflows.monolithic_ipc import IpcHandleStore

STORES = (CommStore, IpcStore, LocalStore, RedisStore, IpcHandleStore)


@pytest.mark.parametrize("store", STORES, ids=lambda cls: cls.__name__)
def test_each_store_accepts_the_key_store_calls(store: type) -> None:
    """The protocol's calls bind to each store's methods (extra parameters have defaults)."""
    for name, args, kwargs in (
        ("put", ("k", object()), {"consumers": 1, "ttl": 1.0, "stream": None}),
        ("put", ("k", object()), {}),
        ("get", ("k",), {"timeout": 1.0}),
        ("get", ("k",), {}),
        ("delete", ("k",), {}),
        ("close", (), {}),
    ):
        inspect.signature(getattr(store, name)).bind(None, *args, **kwargs)
    assert inspect.signature(store.delete).return_annotation in ("bool", bool)


def test_the_proxy_store_protocol_extends_the_key_store() -> None:
    assert issubclass(Store, KeyStore)
    assert {"put", "get", "delete", "close"} <= set(dir(Store))


@pytest.fixture
def local_store(tmp_path: Path) -> Iterator[tuple[LocalStore, StreamPoolAllocator, object]]:
    spec = V100_16GB.with_overrides(context_create_s=0.0, context_memory=0)
    backend = EmulatedBackend(spec=spec, state_dir=tmp_path / "state", timeline=False, mode="functional")
    runtime = backend.open_runtime(0)
    allocator = StreamPoolAllocator(runtime)
    store = LocalStore(runtime, allocator)
    stream = runtime.create_stream()
    yield store, allocator, stream
    store.close()
    stream.destroy()
    runtime.close()
    backend.close()


def test_run_local_store_through_the_protocol(local_store) -> None:
    store, allocator, stream = local_store
    assert isinstance(store, KeyStore)
    runtime = store._runtime
    x = torch.arange(12, dtype=torch.float32)
    tensor = upload_tensor(runtime, x, allocator.allocate, stream)
    store.put("wf/r1/x", tensor, consumers=2, stream=stream, owner="r1")
    first = store.get("wf/r1/x", timeout=1.0)
    assert first.tensor is tensor and not first.consumed and not first.copy and first.ready is not None
    stream.wait_event(first.ready)
    assert torch.equal(download_tensor(runtime, first.tensor, stream), x)  # the producer's own bytes
    assert store.get("wf/r1/x").consumed  # the second of two consumers takes it away
    with pytest.raises(GetTimeout):
        store.get("wf/r1/x", timeout=0.01)
    allocator.free(tensor.address, stream)
    kept = upload_tensor(runtime, x, allocator.allocate, stream)
    store.put("wf/kept", kept, stream=stream)  # no owner: kept until deleted
    assert store.end_request("r1") == 0 and len(store) == 1
    with pytest.raises(StoreError, match="request r1 has ended"):
        store.put("wf/r1/late", kept, owner="r1")
    assert store.delete("wf/kept") is True and store.delete("wf/kept") is False
