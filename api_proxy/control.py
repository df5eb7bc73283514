"""Starting a workflow's proxy process and talking to it over its control socket.

- `launch_proxy(config)`: makes the proxy's owner-only directory, starts the proxy process (from
  that directory, so nothing shadows the installed package) and waits until it answers `ping`.
- `ProxyClient` (blocking) and `AsyncProxyClient` (asyncio): `invoke`, `end_request`, `stats`,
  `shutdown`. Messages are msgpack `[call id, op, args, key]` -> `[call id, ok, value]`.

Authentication: every proxy has a 32-byte random control key. The launcher makes it and hands it to
the proxy process through an inherited pipe (never argv, environment or a file: a function of another
workflow runs as the same user and could read those); the proxy checks it on every control message
(`ControlGuard.open`) and refuses others with `IsolationError`. Clients in the launching process find
the key (and the process, for the liveness check) by the proxy's address in a process-local table,
so `ProxyClient(address)` just works there and nowhere else.

Liveness: a client waiting on a proxy whose process exits fails at once (a pidfd in the poller, or in
the asyncio loop) with `ProxyDied`, naming the exit code; every call in flight fails with it and is
counted (`lost_calls`), and later calls fail immediately.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import os
import secrets
import shutil
import signal
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

from .errors import IsolationError, ProxyError, decode_error, encode_error
from .proxy_config import ProxyConfig
from .shm_ring import private_dir

log = logging.getLogger(__name__)

START_ERROR_FILE = "start_error.txt"
LIVENESS_S = 0.05  # how often a waiting blocking client checks that its proxy process still runs
LAUNCH_PROXY = (  # take_key first: a short window. A Ctrl-C while importing ends it quietly (the
    # terminal's Ctrl-C reaches the proxies too; the command that started them reports the interrupt)
    "import sys\n"
    "try:\n"
    "    from streambox.api_proxy.control import take_key; take_key()\n"
    "    from streambox.api_proxy.proxy_launch import main\n"
    "except KeyboardInterrupt:\n"
    "    sys.exit(130)\n"
    "sys.exit(main())\n"
)


KEY_BYTES = 32
KEY_FD_ENV = "STREAMBOX_CONTROL_KEY_FD"  # the number of the pipe the proxy reads its key from


class ProxyStartError(ProxyError):
    """The proxy process exited or did not answer during start-up; the message says why."""


class ProxyDied(ProxyError):
    """The proxy process exited while (or before) a call waited on it; the message gives the code."""


class ControlRefused(IsolationError):
    """A control message without this proxy's key; `call_id` is what the sender used (or 0)."""

    def __init__(self, message: str, call_id: int = 0) -> None:
        super().__init__(message)
        self.call_id = call_id
        self.wire = encode_error(IsolationError(message))  # the caller sees an IsolationError


def _reply(body: bytes) -> tuple[int, bool, Any]:
    """A reply `[call_id, ok, value]`; maps may have non-string keys, as on the channel (`wire.unpack`)."""
    reply_id, ok, value = msgpack.unpackb(body, raw=False, strict_map_key=False)
    return reply_id, ok, value


def control_address(directory: Path | str) -> str:
    return f"ipc://{Path(directory) / 'control.sock'}"


@dataclass
class _Known:
    key: bytes
    process: subprocess.Popen[bytes] | None  # None: a proxy running inside this process


_KNOWN: dict[str, _Known] = {}  # control address -> key (and process) of proxies this process started


def _known_key(address: str, key: bytes | None) -> bytes:
    if key is not None:
        return key
    known = _KNOWN.get(address)
    return known.key if known is not None else b""


def _exit_reason(process: subprocess.Popen[bytes]) -> str | None:
    """Why the proxy process ended (a signal by its name), or None while it runs."""
    code = process.poll()
    if code is None:
        return None
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"the proxy process was killed by {signal.Signals(-code).name}"
    return f"the proxy process exited with code {code}"


_TAKEN: list[bytes] = []  # the key this process was given (`take_key`), until its guard takes it


def take_key() -> None:
    """(Proxy process, first thing at start) read the control key from the pipe the launcher passed
    and close it, before anything slow runs: the pipe is readable through /proc while it is open."""
    fd = os.environ.pop(KEY_FD_ENV, None)
    if fd is not None:
        with os.fdopen(int(fd), "rb") as pipe:
            _TAKEN.append(pipe.read(KEY_BYTES + 1))


class ControlGuard:
    """The proxy's side of authentication: unpack a control message and check its key."""

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a control key has {KEY_BYTES} bytes, got {len(key)}")
        self._key = key

    @classmethod
    def for_proxy(cls, address: str) -> ControlGuard:
        """The key the launcher piped to this process (`take_key`); a proxy started inside its
        client's process (tests) makes one and registers it for the clients there."""
        take_key()  # a no-op when the launch command took it already
        if _TAKEN:
            return cls(_TAKEN.pop())
        key = secrets.token_bytes(KEY_BYTES)
        _KNOWN[address] = _Known(key, None)
        return cls(key)

    def open(self, body: bytes) -> tuple[int, str, Any]:
        """`(call id, op, args)` of an authentic message; raises `ControlRefused` (or a decoding
        error for bytes that are not a control message at all)."""
        message = msgpack.unpackb(body, raw=False)
        if not isinstance(message, list) or len(message) not in (3, 4):
            raise ValueError("not a control message")
        call_id = message[0] if isinstance(message[0], int) else 0
        key = message[3] if len(message) == 4 else b""
        if not isinstance(key, bytes) or not hmac.compare_digest(key, self._key):
            raise ControlRefused("control call refused: the caller does not hold this proxy's key", call_id)
        return call_id, message[1], message[2]


_CONTEXT: tuple[int, zmq.Context[Any]] | None = None


def process_context() -> zmq.Context[Any]:
    """This process's zmq context for proxy clients (a new one after a fork). Clients close only
    their sockets: a context of their own, left to the garbage collector in a reference cycle,
    would `term()` while its socket (already unreachable, not yet finalized) is still open, and
    hang the process forever."""
    global _CONTEXT
    if _CONTEXT is None or _CONTEXT[0] != os.getpid():
        _CONTEXT = (os.getpid(), zmq.Context(io_threads=1))
    return _CONTEXT[1]


class ProxyClient:
    """A blocking client of one proxy's control socket (one thread at a time)."""

    def __init__(
        self, address: str, alive: Callable[[], str | None] | None = None, *, key: bytes | None = None
    ) -> None:
        """`alive()`, if given, returns None while the proxy runs, else why it does not (by default:
        the exit of a proxy process this process launched). `key`: the proxy's control key (by
        default the one of a proxy this process launched)."""
        self.address = address
        known = _KNOWN.get(address)
        if alive is None and known is not None and known.process is not None:
            process = known.process
            alive = lambda: _exit_reason(process)  # noqa: E731
        self._alive = alive
        self._key = _known_key(address, key)
        self._sock = process_context().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._ids = itertools.count(1)
        self.lost_calls = 0  # calls that failed because the proxy died

    def call(self, op: str, args: Any = None, timeout: float | None = None) -> Any:
        call_id = next(self._ids)
        if self._alive is not None and (gone := self._alive()) is not None:
            self.lost_calls += 1
            raise ProxyDied(f"proxy at {self.address}: {gone} (before {op!r})")
        self._sock.send(msgpack.packb([call_id, op, args or {}, self._key], use_bin_type=True))
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = LIVENESS_S if deadline is None else min(LIVENESS_S, max(0.0, deadline - time.monotonic()))
            if not self._sock.poll(int(left * 1000) + 1):
                gone = self._alive() if self._alive is not None else None
                if gone is not None:
                    self.lost_calls += 1
                    raise ProxyDied(f"proxy at {self.address}: {gone} (while waiting for {op!r})")
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"proxy at {self.address}: no answer to {op!r} within {timeout} s")
                continue
            reply_id, ok, value = _reply(self._sock.recv())
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


class AsyncProxyClient:
    """An asyncio client of one proxy's control socket; calls may run concurrently (one event loop).

    With a process to watch (by default: the proxy this process launched at `address`), its exit
    fails every pending call at once with `ProxyDied` (a pidfd read by the loop; a poll every
    `LIVENESS_S` where pidfds are missing)."""

    def __init__(
        self,
        address: str,
        *,
        key: bytes | None = None,
        process: subprocess.Popen[bytes] | None = None,
    ) -> None:
        self.address = address
        known = _KNOWN.get(address)
        self._process = process if process is not None else (known.process if known else None)
        self._key = _known_key(address, key)
        # A shadow of the process's context: it never terms it (see `process_context`).
        self._ctx = zmq.asyncio.Context(shadow=process_context().underlying)
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._watch: Any = None  # (loop, pidfd) or a polling task, set on the first call
        self._died: str | None = None
        self.lost_calls = 0  # calls failed because the proxy died

    async def _read(self) -> None:
        while True:
            body = await self._sock.recv()
            try:
                reply_id, ok, value = _reply(body)
            except (ValueError, TypeError) as exc:  # one bad reply must not stop every later call's
                log.error("proxy at %s: an undecodable reply dropped: %s", self.address, exc)
                continue
            future = self._pending.pop(reply_id, None)
            if future is None or future.done():
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(decode_error(value))

    def _start_watch(self, loop: asyncio.AbstractEventLoop) -> None:
        process = self._process
        if process is None or self._watch is not None:
            return
        try:
            pidfd = os.pidfd_open(process.pid)
        except (AttributeError, OSError):  # no pidfds here (or the process is reaped): poll instead
            self._watch = loop.create_task(self._poll_exit())
            return
        loop.add_reader(pidfd, self._check_exit)
        self._watch = (loop, pidfd)

    async def _poll_exit(self) -> None:
        while self._died is None:
            await asyncio.sleep(LIVENESS_S)
            self._check_exit()

    def _check_exit(self) -> None:
        assert self._process is not None
        reason = _exit_reason(self._process)
        if reason is None:
            return
        self._stop_watch()
        self._died = reason
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                self.lost_calls += 1
                future.set_exception(
                    ProxyDied(f"proxy at {self.address}: {reason} ({len(pending)} calls in flight failed)")
                )

    def _stop_watch(self) -> None:
        watch, self._watch = self._watch, None
        if isinstance(watch, tuple):
            loop, pidfd = watch
            with contextlib.suppress(Exception):
                loop.remove_reader(pidfd)
            os.close(pidfd)
        elif watch is not None:
            watch.cancel()

    async def call(self, op: str, args: Any = None, timeout: float | None = None) -> Any:
        loop = asyncio.get_running_loop()
        self._start_watch(loop)
        if self._died is not None:
            self.lost_calls += 1
            raise ProxyDied(f"proxy at {self.address}: {self._died} (before {op!r})")
        if self._reader is None or self._reader.done():
            self._reader = loop.create_task(self._read())
        call_id = next(self._ids)
        future: asyncio.Future[Any] = loop.create_future()
        self._pending[call_id] = future
        await self._sock.send(msgpack.packb([call_id, op, args or {}, self._key], use_bin_type=True))
        try:
            # Not `asyncio.wait_for`: on Python 3.11 it returns the reply when the caller is cancelled
            # as the reply arrives, and the caller's loop goes on (the invoker's housekeeping did,
            # and its `close` waited for it forever); `asyncio.timeout` raises the cancellation.
            async with asyncio.timeout(timeout):
                return await future
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

    async def pin(self, pinned: bool) -> bool:
        """Pause (True) or resume (False) the keep-alive of the proxy's instances."""
        return bool(await self.call("pin", {"pinned": pinned}, 30.0))

    def close(self) -> None:
        self._stop_watch()
        if self._reader is not None:
            self._reader.cancel()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ProxyError(f"proxy client {self.address} closed"))
        self._sock.close(0)


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

    @property
    def exit_reason(self) -> str | None:
        """Why the process ended (`the proxy process was killed by SIGKILL`), None while it runs."""
        return _exit_reason(self.process)

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
        _KNOWN.pop(self.address, None)
        shutil.rmtree(self.directory, ignore_errors=True)
        return self.process.returncode


def launch_proxy(
    config: ProxyConfig, *, timeout: float = 600.0, env: dict[str, str] | None = None
) -> ProxyProcess:
    """Start the proxy of `config.workflow` and wait until it serves (runtime open, models loaded,
    template warm). Its stdout/stderr (and its instances') go to this process's."""
    directory = private_dir(f"sbx-{config.workflow[:16]}-")
    config = config.with_overrides(directory=str(directory))
    key = secrets.token_bytes(KEY_BYTES)
    key_r, key_w = os.pipe()  # the key's only way into the proxy (a pipe buffer holds 32 bytes)
    os.write(key_w, key)
    os.close(key_w)
    child_env = dict(os.environ if env is None else env)
    child_env[KEY_FD_ENV] = str(key_r)
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", LAUNCH_PROXY, config.to_json()],
            cwd=directory,
            env=child_env,
            close_fds=True,
            pass_fds=(key_r,),
        )
    finally:
        os.close(key_r)
    address = control_address(directory)
    _KNOWN[address] = _Known(key, process)
    client = ProxyClient(address, key=key)
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
            with contextlib.suppress(TimeoutError, ProxyDied):  # an exit is reported above
                info = client.call("ping", {}, 0.2)
                return ProxyProcess(config, directory, process, client, info)
    except BaseException:
        client.close()
        _KNOWN.pop(address, None)
        if process.poll() is None:
            process.kill()
            process.wait()
        shutil.rmtree(directory, ignore_errors=True)
        raise
