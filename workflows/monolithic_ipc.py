"""Astraea's data path: CUDA-IPC handles, the intermediate data cached in the producer's GPU memory.

Astraea (paper Table 2) runs a process and a runtime per function instance, like INFless, but passes
data between functions by CUDA IPC instead of through external storage. Here, per key `K`:

- **PUT** (producer instance): the tensor stays where it is, in the producer's own runtime (its
  allocation is counted in the device ledger under the producer's runtime: Astraea's intermediate
  data is cached in GPU memory, which is why its footprint is larger than INFless's, Fig. 12). The
  producer exports a handle (modelled `CudaIpcModel.export_s`) and publishes the key's metadata in
  the invoker's handle registry.
- **GET** (consumer instance, another process): opens the handle (modelled `open_s`), copies the
  bytes device-to-device into its own runtime (a copy on its stream at the device's
  `device_bandwidth`) and closes the handle (modelled `close_s`). Like INFless's GET, the copy is
  private to the consumer and freed at the end of its invocation.
- **Freeing**: a GET that takes the key's last consumer, a DELETE, the key's TTL or the end of its
  request (`end_request` writes a marker) retires the key; the producer frees the allocation the
  next time it looks (`reap`: at every PUT/GET it makes and every `REAP_PERIOD_S` while idle).

Why a mirror: on the emulated device every process has its own address space (device memory is
host memory of the process that allocated it), so a real IPC mapping cannot exist. In functional
mode the exported allocation's bytes are mirrored once, at export, into a POSIX shared-memory
segment that the consumer maps when it opens the handle (host work that stands in for the shared
physical memory; it is not counted as device time). In timed mode data is phantom and nothing is
mirrored; the open/close costs and the device-to-device copy are charged the same way in both modes.
The open/close/export constants are **modelled** (`comm.baselines.CudaIpcModel`: assumptions of the
order of magnitude, no public per-call figure; see there).

The handle registry is a directory shared by the invoker and its instances (no Redis): one JSON file
per live key (`keys/<sha1 of K>.json`: producer pid, segment, dtype, shape, strides, bytes,
consumers left, request, expiry), one marker per ended request (`ended/<sha1 of W/R>`), and a lock
file (`fcntl.flock`) that makes claiming a consumer atomic across processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Any

import torch

from streambox.api_proxy.device_tensor import DeviceTensor
from streambox.comm.baselines import CudaIpcModel, busy_wait
from streambox.comm.lease import Allocator
from streambox.comm.store_protocol import check_put_args
from streambox.device import Runtime, Stream

from .local import Got, StoreError, poll_get

#: How often an idle producer instance looks for retired keys to free.
REAP_PERIOD_S = 0.005
#: A waiting GET looks for its key at most this far apart.
GET_POLL_MAX_S = 0.005


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


class HandleRegistry:
    """The shared directory of exported handles (see the module); every method is process-safe."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.keys = root / "keys"
        self.ended = root / "ended"

    @classmethod
    def create(cls, root: Path) -> HandleRegistry:
        registry = cls(root)
        registry.keys.mkdir(parents=True, exist_ok=True)
        registry.ended.mkdir(parents=True, exist_ok=True)
        (root / "lock").touch()
        return registry

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with (self.root / "lock").open("rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def key_path(self, key: str) -> Path:
        return self.keys / f"{_digest(key)}.json"

    def ended_path(self, workflow: str, request_id: str) -> Path:
        return self.ended / _digest(f"{workflow}/{request_id}")

    def end_request(self, workflow: str, request_id: str) -> None:
        """Mark the request ended: its keys are retired, its later PUTs refused."""
        self.ended_path(workflow, request_id).touch()

    def forget_ended(self, older_than_s: float) -> int:
        """Drop the markers of requests that ended more than `older_than_s` ago; how many went."""
        cutoff = time.time() - older_than_s
        gone = 0
        for marker in self.ended.iterdir():
            with contextlib.suppress(FileNotFoundError):
                if marker.stat().st_mtime < cutoff:
                    marker.unlink()
                    gone += 1
        return gone

    def read(self, key: str) -> dict[str, Any] | None:
        """The key's metadata, or None (never put, retired, or past its TTL). Call under `locked`."""
        path = self.key_path(key)
        try:
            meta = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        if meta["expires"] is not None and meta["expires"] <= time.time():
            path.unlink(missing_ok=True)
            return None
        return meta

    def live_producers(self) -> set[int]:
        """The processes (pids) that exported a key still to be taken (not retired, expired, or of an
        ended request): their memory backs it, so they must outlive it (a keep-alive that stops one
        takes the key with it)."""
        producers: set[int] = set()
        now = time.time()
        with self.locked():
            for path in self.keys.glob("*.json"):
                with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                    meta = json.loads(path.read_text())
                    live = meta["expires"] is None or meta["expires"] > now
                    if live and not self.ended_path(meta["workflow"], meta["request"]).exists():
                        producers.add(int(meta["producer"]))
        return producers

    def publish(self, key: str, meta: dict[str, Any]) -> None:
        """Write a new key's metadata atomically (call under `locked`, after checking it is new)."""
        path = self.key_path(key)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        partial.write_text(json.dumps(meta))
        partial.replace(path)

    def retire(self, key: str) -> bool:
        """Remove the key's metadata; False if there was none. Call under `locked`."""
        try:
            self.key_path(key).unlink()
        except FileNotFoundError:
            return False
        return True


@dataclass
class _Exported:
    """A key this instance put: its allocation stays in this runtime until the key is retired."""

    handle: DeviceTensor
    segment: shared_memory.SharedMemory | None
    workflow: str
    request_id: str
    expires: float | None


class IpcHandleStore:
    """An instance's keys by CUDA-IPC handle (what `RedisStore` is for INFless; see the module)."""

    def __init__(
        self,
        registry: HandleRegistry,
        workflow: str,
        runtime: Runtime,
        allocator: Allocator,
        model: CudaIpcModel | None = None,
    ) -> None:
        spec = getattr(runtime, "spec", None)
        if spec is None:
            raise StoreError(
                "astraea's CUDA-IPC data path runs on the emulated device only (it mirrors exported "
                f"memory between processes); this runtime is a {type(runtime).__name__}"
            )
        self.registry = registry
        self.workflow = workflow
        self.model = model or CudaIpcModel()
        self._runtime = runtime
        self._allocator = allocator
        self._timed = bool(getattr(runtime, "timed", False))
        self._device_bandwidth = float(spec.link.device_bandwidth)
        self._stream = runtime.create_stream()  # frees of retired keys
        self._exported: dict[str, _Exported] = {}
        # A batched message runs its members' handlers on threads of one instance: its exported keys
        # and counters are shared between them.
        self._lock = threading.RLock()
        self.opened = 0  # handles this instance opened (GETs)
        self.exported = 0  # handles this instance exported (PUTs)
        self.cached_peak_bytes = 0  # the most `cached_bytes` ever was

    @property
    def cached_bytes(self) -> int:
        """Bytes this instance holds in GPU memory for keys it put and nobody retired yet."""
        with self._lock:
            return sum(e.handle.nbytes for e in self._exported.values())

    def put(
        self,
        key: str,
        value: DeviceTensor,
        *,
        consumers: int | None = None,
        ttl: float | None = None,
        stream: Stream | None = None,
        owner: str | None = None,
    ) -> None:
        """Export `value` under `key` once `stream`'s work so far is done (the producer keeps the
        allocation until the key is retired); `owner`: the request whose end retires the key (None:
        kept until deleted or expired)."""
        check_put_args(key, consumers)  # the same PUT rules as the proxy's stores
        handle, request_id = value, owner or ""  # "": no request has ended under that name
        self.reap()
        if stream is not None:
            stream.synchronize()  # the producer's kernels are done before the handle is published
        segment = None if self._timed else self._mirror(handle)
        expires = None if ttl is None else time.time() + ttl
        meta = {
            "key": key,
            "producer": os.getpid(),
            "segment": segment.name if segment is not None else None,
            "nbytes": handle.nbytes,
            "dtype": str(handle.dtype).removeprefix("torch."),
            "shape": list(handle.shape),
            "strides": list(handle.strides),
            "left": -1 if consumers is None else consumers,
            "request": request_id,
            "workflow": self.workflow,
            "expires": expires,
        }
        registry = self.registry
        with registry.locked():
            refusal = None
            if registry.ended_path(self.workflow, request_id).exists():
                refusal = f"request {request_id} has ended: PUT of key {key!r} refused"
            elif registry.read(key) is not None:
                refusal = f"key {key!r} is already stored; delete it first"
            else:
                registry.publish(key, meta)
        if refusal is not None:
            _drop(segment)
            raise StoreError(refusal)
        busy_wait(self.model.export_s)  # cuIpcGetMemHandle (modelled)
        with self._lock:
            self._exported[key] = _Exported(handle, segment, self.workflow, request_id, expires)
            self.exported += 1
            self.cached_peak_bytes = max(self.cached_peak_bytes, self.cached_bytes)

    def _mirror(self, handle: DeviceTensor) -> shared_memory.SharedMemory:
        """The allocation's bytes in a shared segment other processes can map (functional mode)."""
        segment = shared_memory.SharedMemory(create=True, size=max(1, handle.nbytes))
        source = self._runtime.view(handle.address, torch.uint8, (handle.nbytes,))
        target = torch.frombuffer(segment.buf, dtype=torch.uint8, count=handle.nbytes)
        target.copy_(source)
        del target  # the segment can only close once no tensor views it
        return segment

    def get(self, key: str, *, timeout: float | None = None, stream: Stream | None = None) -> Got:
        """A private copy of the key's tensor in this runtime (on `stream`; None: the store's), and
        whether this GET took the key's last consumer. Waits until someone puts the key, up to
        `timeout` seconds."""
        reader = stream or self._stream
        return poll_get(key, timeout, lambda: self._take(key, reader), 0.0005, GET_POLL_MAX_S)

    def _take(self, key: str, stream: Stream) -> Got | None:
        """One try of a GET: a consumer claimed and the bytes copied in, or None."""
        self.reap()
        claimed = self._claim(key)
        if claimed is None:
            return None
        meta, segment, last = claimed
        try:
            return Got(self._copy_in(meta, segment, stream), last, True, None)
        finally:
            _detach(segment)

    def _claim(self, key: str) -> tuple[dict[str, Any], shared_memory.SharedMemory | None, bool] | None:
        """Take one consumer of the key (mapping its segment first: the producer may free it as soon
        as the last consumer is taken); None if the key is not there."""
        registry = self.registry
        with registry.locked():
            meta = registry.read(key)
            if meta is None:
                return None
            try:
                segment = _attach(meta["segment"]) if meta["segment"] is not None else None
            except FileNotFoundError:
                registry.retire(key)
                raise StoreError(
                    f"GET of key {key!r}: its producer (pid {meta['producer']}) is gone and its data with it"
                ) from None
            last = False
            if meta["left"] > 0:
                meta["left"] -= 1
                last = meta["left"] == 0
                if last:
                    registry.retire(key)
                else:
                    registry.publish(key, meta)
        return meta, segment, last

    def _copy_in(
        self, meta: dict[str, Any], segment: shared_memory.SharedMemory | None, stream: Stream
    ) -> DeviceTensor:
        """cuIpcOpenMemHandle, a device-to-device copy into this runtime, cuIpcCloseMemHandle."""
        nbytes = int(meta["nbytes"])
        busy_wait(self.model.open_s)  # modelled
        address = self._allocator.allocate(nbytes, stream)
        runtime = self._runtime

        def copy() -> None:  # functional mode: the bytes through the mapping
            assert segment is not None
            source = torch.frombuffer(segment.buf, dtype=torch.uint8, count=nbytes)
            runtime.view(address, torch.uint8, (nbytes,)).copy_(source)
            del source

        runtime.launch(stream, copy, name="ipc-copy", duration_s=nbytes / self._device_bandwidth)
        stream.synchronize()  # the mapping closes after the copy
        busy_wait(self.model.close_s)  # modelled
        with self._lock:
            self.opened += 1
        dtype = getattr(torch, meta["dtype"])
        return DeviceTensor(address, dtype, tuple(meta["shape"]), tuple(meta["strides"]), nbytes)

    def delete(self, key: str) -> bool:
        with self.registry.locked():
            retired = self.registry.retire(key)
        self.reap()
        return retired

    def reap(self) -> int:
        """Free the allocations of this instance's keys that were retired (last consumer, DELETE,
        TTL, end of request). Returns how many went."""
        with self._lock:  # one reaper at a time: a key is listed and popped once
            if not self._exported:
                return 0
            now = time.time()
            registry = self.registry
            gone = [
                key
                for key, e in self._exported.items()
                if not registry.key_path(key).exists()
                or (e.expires is not None and e.expires <= now)
                or registry.ended_path(e.workflow, e.request_id).exists()
            ]
            if not gone:
                return 0
            with registry.locked():
                for key in gone:
                    registry.retire(key)
            for key in gone:
                entry = self._exported.pop(key)
                self._allocator.free(entry.handle.address, self._stream)
                _drop(entry.segment)
            self._stream.synchronize()
            return len(gone)

    def close(self) -> None:
        with self._lock, self.registry.locked():
            for key in self._exported:
                self.registry.retire(key)
        self.reap()
        self._stream.synchronize()
        self._stream.destroy()


def _attach(name: str) -> shared_memory.SharedMemory:
    segment = shared_memory.SharedMemory(name=name)
    # Python < 3.13 registers attached segments with this process's resource tracker, which would
    # unlink the producer's segment when the consumer exits: the producer owns it.
    with contextlib.suppress(Exception):
        resource_tracker.unregister(segment._name, "shared_memory")  # type: ignore[attr-defined]
    return segment


def _detach(segment: shared_memory.SharedMemory | None) -> None:
    if segment is not None:
        segment.close()


def _drop(segment: shared_memory.SharedMemory | None) -> None:
    if segment is not None:
        segment.close()
        with contextlib.suppress(FileNotFoundError):
            segment.unlink()

