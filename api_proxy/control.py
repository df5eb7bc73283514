"""Starting a workflow's proxy process and talking to it over its control socket.

- `launch_proxy(config)`: makes the proxy's owner-only directory, starts the proxy process (from
  that directory, so nothing shadows the installed package) and waits until it answers `ping`.
- `ProxyClient` (blocking) and `AsyncProxyClient` (asyncio): `invoke`, `end_request`, `stats`,
  `shutdown`. Messages are msgpack `[call id, op, args]` -> `[call id, ok, value]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from .errors import ProxyError, decode_error
from .proxy_config import ProxyConfig
from .shm_ring import private_dir

START_ERROR_FILE = "start_error.txt"
LIVENESS_S = 0.5  # how often a waiting client checks that its proxy process still runs
LAUNCH_PROXY = "import sys; from streambox.api_proxy.proxy import main; sys.exit(main())"


class ProxyStartError(ProxyError):
    """The proxy process exited or did not answer during start-up; the message says why."""


def control_address(directory: Path | str) -> str:
    return f"ipc://{Path(directory) / 'control.sock'}"


class ProxyClient:
    """A blocking client of one proxy's control socket (one thread at a time)."""

    def __init__(self, address: str, alive: Callable[[], str | None] | None = None) -> None:
        """`alive()`, if given, returns None while the proxy runs, else why it does not."""
        self.address = address
        self._alive = alive
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._ids = itertools.count(1)

    def call(self, op: str, args: Any = None, timeout: float | None = None) -> Any:
        call_id = next(self._ids)
        self._sock.send(msgpack.packb([call_id, op, args or {}], use_bin_type=True))
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = LIVENESS_S if deadline is None else min(LIVENESS_S, max(0.0, deadline - time.monotonic()))
            if not self._sock.poll(int(left * 1000) + 1):
                gone = self._alive() if self._alive is not None else None
                if gone is not None:
                    raise ProxyError(f"proxy at {self.address}: {gone} (while waiting for {op!r})")
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"proxy at {self.address}: no answer to {op!r} within {timeout} s")
                continue
            reply_id, ok, value = msgpack.unpackb(self._sock.recv(), raw=False)
            if reply_id == call_id:
                if not ok:
                    raise decode_error(value)
                return value

    def invoke(
        self, function: str, event: Any, request_id: str = "", timeout_s: float | None = None
    ) -> dict[str, Any]:
        """`{"output", "cold_start", "latency_s", "start_s", "queue_s", "instance"}`; a failed request
        raises its error (`FunctionFailed`, `FunctionCrashed`, `FunctionTimeout`, ...)."""
        args = {"function": function, "event": event, "request_id": request_id, "timeout_s": timeout_s}
        return self.call("invoke", args, None if timeout_s is None else timeout_s + 30.0)

    def end_request(self, request_id: str) -> int:
        return self.call("end_request", {"request_id": request_id}, 30.0)

    def stats(self) -> dict[str, Any]:
        return self.call("stats", {}, 30.0)

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()


class AsyncProxyClient:
    """An asyncio client of one proxy's control socket; calls may run concurrently (one event loop)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self._ctx = zmq.asyncio.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def _read(self) -> None:
        while True:
            reply_id, ok, value = msgpack.unpackb(await self._sock.recv(), raw=False)
            future = self._pending.pop(reply_id, None)
            if future is None or future.done():
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(decode_error(value))

    async def call(self, op: str, args: Any = None, timeout: float | None = None) -> Any:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read())
        call_id = next(self._ids)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        await self._sock.send(msgpack.packb([call_id, op, args or {}], use_bin_type=True))
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self._pending.pop(call_id, None)

    async def invoke(
        self, function: str, event: Any, request_id: str = "", timeout_s: float | None = None
    ) -> dict[str, Any]:
        args = {"function": function, "event": event, "request_id": request_id, "timeout_s": timeout_s}
        return await self.call("invoke", args, None if timeout_s is None else timeout_s + 30.0)

    async def end_request(self, request_id: str) -> int:
        return await self.call("end_request", {"request_id": request_id}, 30.0)

    async def stats(self) -> dict[str, Any]:
        return await self.call("stats", {}, 30.0)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ProxyError(f"proxy client {self.address} closed"))
        self._sock.close(0)
        self._ctx.term()


@dataclass
class ProxyProcess:
    """A running proxy process and its blocking control client."""

    config: ProxyConfig
    directory: Path
    process: subprocess.Popen[bytes]
    client: ProxyClient
    info: dict[str, Any]

    @property
    def address(self) -> str:
        return control_address(self.directory)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 20.0) -> int | None:
        """Shut the proxy down (its instances and template with it); returns its exit code."""
        if self.alive:
            with contextlib.suppress(Exception):
                self.client.call("shutdown", {}, 5.0)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.terminate()
                try:
                    self.process.wait(5.0)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
        self.client.close()
        shutil.rmtree(self.directory, ignore_errors=True)
        return self.process.returncode


def launch_proxy(
    config: ProxyConfig, *, timeout: float = 600.0, env: dict[str, str] | None = None
) -> ProxyProcess:
    """Start the proxy of `config.workflow` and wait until it serves (runtime open, models loaded,
    template warm). Its stdout/stderr (and its instances') go to this process's."""
    directory = private_dir(f"sbx-{config.workflow[:16]}-")
    config = config.with_overrides(directory=str(directory))
    process = subprocess.Popen(
        [sys.executable, "-c", LAUNCH_PROXY, config.to_json()], cwd=directory, env=env, close_fds=True
    )

    def alive() -> str | None:
        code = process.poll()
        return None if code is None else f"the proxy process exited with code {code}"

    client = ProxyClient(control_address(directory), alive)
    deadline = time.monotonic() + timeout
    try:
        while True:
            code = process.poll()
            if code is not None:
                error_file = directory / START_ERROR_FILE
                why = error_file.read_text() if error_file.exists() else f"exit code {code}"
                raise ProxyStartError(f"the proxy of workflow {config.workflow!r} did not start: {why}")
            if time.monotonic() > deadline:
                process.kill()
                raise ProxyStartError(
                    f"the proxy of workflow {config.workflow!r} did not start in {timeout} s"
                )
            with contextlib.suppress(TimeoutError):
                info = client.call("ping", {}, 0.2)
                return ProxyProcess(config, directory, process, client, info)
    except BaseException:
        client.close()
        if process.poll() is None:
            process.kill()
            process.wait()
        shutil.rmtree(directory, ignore_errors=True)
        raise
