"""Baselines for PUT/GET: Func-IPC through a real Redis server, and CUDA-IPC style handles (modelled).

- `FuncIpc`: how INFless-like systems pass intermediate data between functions: the producer copies
  its output GPU -> host and writes it to external storage (Redis); the consumer reads it back and
  copies host -> GPU. Everything here is real (the Redis server, the client, the host copies); the
  device copies follow the emulated link model when run on the emulated device.
- `CudaIpcModel`: each transfer exports an IPC handle for the producer's allocation
  (cuIpcGetMemHandle), opens it in the consumer's context (cuIpcOpenMemHandle: maps the memory into
  the consumer's address space) and closes it afterwards (cuIpcCloseMemHandle). No bytes move. The
  emulated device has one address space per process, so these costs are **modelled** (slept), not
  measured: the defaults are assumptions of the order of magnitude, labelled as such wherever they
  are reported. The CUDA documentation calls the export "a lightweight operation"; PyTorch
  (`getCachedCUDAIpcDevptr`), UCX (openucx/ucx #2738, #4599) and MVAPICH2 all cache opened handles
  because opening one per transfer is expensive; we found no public per-call figure to cite, so
  `open_s` (150 us) and `close_s` (50 us) are assumptions to be replaced by a measurement on a GPU.
- `RedisServer`: starts `redis-server` on a free loopback port in a private (0700) temporary
  directory (no persistence) and stops it; `RedisUnavailable` says why it cannot (the binary or the
  `redis` package is missing). Safe by default: protected mode on, and a generated password that
  lives only in a 0600 config file and a 0600 password file of that directory (never on a command
  line); `client()` and `connection()` carry it.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from streambox.device import Runtime, Stream

from .lease import Allocator, DeviceTensorLike


class RedisUnavailable(RuntimeError):
    """Redis cannot be used here; the message says what is missing and how to get it."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A private redis-server for one test or benchmark run."""

    def __init__(self, executable: str | None = None, start_timeout_s: float = 10.0) -> None:
        self.executable = executable or shutil.which("redis-server")
        self.start_timeout_s = start_timeout_s
        self.port = 0
        self.password = ""
        self.password_file: Path | None = None  # 0600, for processes that must connect too
        self._dir: Path | None = None
        self._proc: subprocess.Popen | None = None

    @staticmethod
    def why_unavailable(executable: str | None = None) -> str | None:
        """None when a server can be started here, else the reason."""
        try:
            import redis  # noqa: F401
        except ImportError:
            return "the `redis` Python package is not installed (pip install redis)"
        if (executable or shutil.which("redis-server")) is None:
            return "redis-server is not on PATH (Debian: apt-get install -y redis-server)"
        return None

    def start(self) -> RedisServer:
        why = self.why_unavailable(self.executable)
        if why is not None or self.executable is None:
            raise RedisUnavailable(why or "redis-server is not on PATH")
        import redis

        self._dir = Path(tempfile.mkdtemp(prefix="streambox-redis-"))  # 0700
        self.port = _free_port()
        self.password = secrets.token_urlsafe(32)
        self.password_file = _private_file(self._dir / "password", self.password)
        conf = _private_file(
            self._dir / "redis.conf",
            f"port {self.port}\nbind 127.0.0.1\nprotected-mode yes\nrequirepass {self.password}\n"
            f'dir {self._dir}\nsave ""\nappendonly no\n',
        )
        try:
            self._proc = subprocess.Popen(
                [self.executable, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
            )
        except OSError as exc:
            self.stop()
            raise RedisUnavailable(f"cannot run {self.executable}: {exc}") from exc
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode(errors="replace") if self._proc.stderr else ""
                self.stop()
                raise RedisUnavailable(f"redis-server exited at start: {err.strip()[:500]}")
            try:
                if redis.Redis(**self.connection(), socket_connect_timeout=0.2).ping():
                    return self
            except redis.exceptions.ConnectionError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RedisUnavailable(f"redis-server did not answer on port {self.port} within "
                                       f"{self.start_timeout_s:g} s")
            time.sleep(0.02)

    def connection(self) -> dict[str, Any]:
        """Keyword arguments of `redis.Redis` (and `redis.asyncio.Redis`) for this server."""
        return {"host": "127.0.0.1", "port": self.port, "password": self.password}

    def client(self) -> Any:
        import redis

        return redis.Redis(**self.connection())

    def stop(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
                try:
                    self._proc.wait(10)
                except subprocess.TimeoutExpired:
                    self._proc.kill()
                    self._proc.wait()
            if self._proc.stderr is not None:
                self._proc.stderr.close()
            self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _private_file(path: Path, text: str) -> Path:
    """A new file only its owner can read (0600) holding `text`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return path


@dataclass(frozen=True)
class Received:
    """What a Func-IPC GET leaves on the consumer's GPU."""

    address: int
    nbytes: int


class FuncIpc:
    """GPU -> host -> Redis -> host -> GPU, synchronous, as a function-per-process system does it."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.last_redis_s = 0.0  # wall time of the Redis call in the latest put or get


    def put(self, key: str, runtime: Runtime, tensor: DeviceTensorLike, stream: Stream) -> None:
        host = torch.empty(tensor.nbytes, dtype=torch.uint8)  # pageable, as a plain cudaMemcpy target
        runtime.copy_dtoh_async(host, tensor.address, tensor.nbytes, stream)
        stream.synchronize()
        started = time.perf_counter()
        self.client.set(key, memoryview(host.numpy()))
        self.last_redis_s = time.perf_counter() - started

    def get(self, key: str, runtime: Runtime, allocator: Allocator, stream: Stream) -> Received:
        started = time.perf_counter()
        data = self.client.get(key)
        self.last_redis_s = time.perf_counter() - started
        if data is None:
            raise KeyError(f"Func-IPC GET {key!r}: not in external storage")
        with warnings.catch_warnings():  # the bytes are only read: no copy to make them writable
            warnings.simplefilter("ignore", UserWarning)
            host = torch.frombuffer(data, dtype=torch.uint8)
        address = allocator.allocate(len(data), stream)
        runtime.copy_htod_async(address, host, len(data), stream)
        stream.synchronize()
        return Received(address, len(data))

    def delete(self, key: str) -> None:
        self.client.delete(key)


@dataclass(frozen=True)
class CudaIpcModel:
    """Per-transfer costs of passing a device pointer by CUDA IPC handle (modelled: see the module)."""

    export_s: float = 5e-6
    open_s: float = 150e-6
    close_s: float = 50e-6
    label: str = "CUDA-IPC style (modelled: export 5 us + open 150 us + close 50 us, assumed)"

    def get(self, tensor: DeviceTensorLike) -> int:
        """The consumer's address for the producer's tensor (the same memory), after export + open."""
        busy_wait(self.export_s + self.open_s)
        return tensor.address

    def release(self) -> None:
        busy_wait(self.close_s)


def busy_wait(seconds: float) -> None:
    """A modelled host-side cost, busy-waited: time.sleep cannot resolve tens of microseconds reliably."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
