"""The function side: the `ctx` a handler gets, the futures of forwarded calls, the instance loop.

A function instance is a process without any device context. Its handler calls `ctx.infer`,
`ctx.put`, ... and each call is forwarded to the workflow's proxy as one msgpack message; the proxy
runs it on the instance's stream and replies. Calls are asynchronous underneath: `*_async` methods
and the fire-and-forget ones (`put`, `delete`, `free`, `memcpy`, `launch`) return a `Future` at once;
the plain methods wait for their reply. Before the instance reports an invocation's result it waits
for every outstanding reply, and an asynchronous call that failed without anyone looking at its
future fails the invocation.

Torch is imported only when a tensor crosses the channel (`upload`, `download`, `infer` of a CPU
tensor). One `Context` serves one thread.
"""

from __future__ import annotations

import contextlib
import json
import operator
import os
import threading
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from streambox.sdk import GET_TIMEOUT_S, error_message_of, error_type_of

from . import wire
from .channel import ClientChannel
from .errors import ChannelClosed, FunctionFailed, ProxyError, decode_error
from .handles import DTYPES, Handle, handle_in_json, qualify_key, request_key
from .host_memory import allow_report, limit_host_memory, out_of_host_memory

if TYPE_CHECKING:
    import torch

_PENDING = object()


class Future:
    """The reply to one forwarded call."""

    __slots__ = ("_client", "_id", "_value", "_error", "_convert", "_seen", "op")

    def __init__(self, client: Client, call_id: int, op: str, convert: Callable[[Any], Any] | None) -> None:
        self._client = client
        self._id = call_id
        self._value: Any = _PENDING
        self._error: BaseException | None = None
        self._convert = convert
        self._seen = False
        self.op = op

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "done")
        return f"<Future {self.op} #{self._id} {state}>"

    def done(self) -> bool:
        return self._value is not _PENDING or self._error is not None

    def _resolve(self, ok: bool, value: Any) -> None:
        if ok:
            self._value = self._convert(value) if self._convert is not None else value
        else:
            self._error = decode_error(value)

    def result(self, timeout: float | None = None) -> Any:
        """Wait for the reply; raises the error the proxy reported."""
        while not self.done():
            self._client.pump(timeout, until=self.done)
        self._seen = True
        if self._error is not None:
            raise self._error
        return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        while not self.done():
            self._client.pump(timeout, until=self.done)
        self._seen = True
        return self._error


class Client:
    """Calls and replies over one channel, and the messages that start or stop invocations.

    Thread-safe: a handler's own threads may call during its invocation. One thread at a time sends
    and one receives; a reply resolves whichever thread's future it answers."""

    def __init__(self, channel: ClientChannel) -> None:
        self.channel = channel
        self._ids = 0
        self._futures: dict[int, Future] = {}
        self._settled: list[Future] = []  # resolved while nobody waited on them
        self.inbox: deque[list[Any]] = deque()  # INVOKE and STOP messages
        self._sending = threading.Lock()
        self._receiving = threading.Lock()

    def call(self, op: str, args: list[Any], convert: Callable[[Any], Any] | None = None) -> Future:
        with self._sending:
            self._ids += 1
            data = wire.pack([wire.CALL, self._ids, op, args])
            future = Future(self, self._ids, op, convert)
            self._futures[self._ids] = future
            self.channel.send(data)
        return future

    def pump(self, timeout: float | None = None, until: Callable[[], bool] | None = None) -> None:
        """Receive one message: a reply resolves its future, anything else waits in `inbox`; at once
        if `until()` holds once this thread may receive (another thread received it meanwhile)."""
        with self._receiving:
            if until is None or not until():
                self._pump(timeout)

    def _pump(self, timeout: float | None) -> None:
        data = self.channel.recv(timeout)
        if data is None:
            raise TimeoutError(f"no reply from the proxy within {timeout} s")
        message = wire.unpack(data)
        if message[0] == wire.REPLY:
            _, call_id, ok, value = message
            future = self._futures.pop(call_id, None)
            if future is not None:  # replies to futures already given up on are dropped
                future._resolve(ok, value)
                if not ok:
                    self._settled.append(future)
        elif message[0] in (wire.INVOKE, wire.STOP):
            self.inbox.append(message)
        else:
            raise ChannelClosed(f"unexpected message from the proxy: {message!r:.120}")

    def next_message(self, timeout: float | None = None) -> list[Any]:
        while not self.inbox:
            self.pump(timeout, until=lambda: bool(self.inbox))
        return self.inbox.popleft()

    def flush(self) -> None:
        """Wait for every outstanding reply; raise the first error no caller has looked at."""
        while self._futures:
            self.pump()
        unseen = [f for f in self._settled if not f._seen]
        self._settled.clear()
        if unseen:
            first = unseen[0]
            error = first._error
            assert error is not None
            error.add_note(f"(from an asynchronous {first.op} whose future nobody checked)")
            raise error


# -- tensors over the wire ----------------------------------------------------------------------------


def tensor_payload(tensor: torch.Tensor) -> list[Any]:
    """`[dtype, shape, bytes]` of a CPU tensor (contiguous copy if needed)."""
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor or a device handle, got {type(tensor).__name__}")
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise TypeError(f"dtype {t.dtype} cannot cross the channel; supported: {sorted(DTYPES)}")
    data = t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b""
    return [dtype, list(t.shape), data]


def tensor_from_payload(
    dtype: str, shape: Sequence[int], strides: Sequence[int], data: bytes
) -> torch.Tensor:
    import torch

    torch_dtype = getattr(torch, dtype)
    if not data:
        return torch.empty(tuple(shape), dtype=torch_dtype)
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(torch_dtype)
    return flat.as_strided(tuple(shape), tuple(strides))


def _handles(value: Any) -> list[Handle]:
    return [Handle.from_wire(h) for h in value]


def _input(obj: Any) -> Any:
    if isinstance(obj, Handle):
        return list(obj)
    if _is_handle(obj):
        return list(Handle.from_wire(obj))
    return {"tensor": tensor_payload(obj)}


class ProxyContext:
    """What a handler behind the API proxy gets as `ctx`: `streambox.Context` plus the low-level
    calls (see the module doc and `docs/api_proxy.md`)."""

    def __init__(
        self, client: Client, *, workflow: str, function: str, request_id: str, instance_id: int
    ) -> None:
        self._client: Client | _Ended = client
        self.workflow = workflow
        self.function = function
        self.request_id = request_id
        self.instance_id = instance_id

    def _end(self) -> None:
        """The invocation is over: a call through this context (a thread the handler left running)
        raises, instead of acting in whatever invocation the instance serves next."""
        self._client = _Ended(self)

    def __repr__(self) -> str:
        return f"<ProxyContext {self.workflow}/{self.function} request={self.request_id}>"

    # -- keys ---------------------------------------------------------------------------------
    def key(self, name: str) -> str:
        """The request-scoped key `<workflow>/<request id>/<name>`."""
        return request_key(self.workflow, self.request_id, name)

    def _key(self, key: str) -> str:
        return qualify_key(self.workflow, key)

    # -- data ---------------------------------------------------------------------------------
    def upload_async(self, tensor: torch.Tensor) -> Future:
        return self._client.call("upload", [tensor_payload(tensor)], Handle.from_wire)

    def upload(self, tensor: torch.Tensor) -> Handle:
        """Copy a CPU tensor to device memory (through the proxy's IO path); returns its handle."""
        return self.upload_async(tensor).result()

    def download_async(self, handle: Handle) -> Future:
        h = Handle.from_wire(handle)
        return self._client.call(
            "download", [list(h)], lambda data: tensor_from_payload(h.dtype, h.shape, h.strides, data)
        )

    def download(self, handle: Handle) -> torch.Tensor:
        """Copy a device tensor back into a new CPU tensor (waits for the work that produced it)."""
        return self.download_async(handle).result()

    def infer_async(self, model: str, inputs: Any) -> Future:
        items = list(inputs) if isinstance(inputs, list) and not _is_handle(inputs) else [inputs]
        return self._client.call("infer", [model, [_input(x) for x in items]], _handles)

    def infer(self, model: str, inputs: Any) -> list[Handle]:
        """Run `model` on the instance's stream; `inputs`: a handle, a CPU tensor, or a list of them
        (one per plan input). Returns the output handles at once (the kernels run asynchronously)."""
        return self.infer_async(model, inputs).result()

    def put(self, key: str, handle: Handle, consumers: int | None = None, ttl: float | None = None) -> Future:
        """Publish `handle` under `key` (zero-copy); freed after `consumers` GETs, `ttl` seconds, a
        DELETE or the end of its request. Asynchronous: the future can be ignored."""
        if isinstance(consumers, int) and not wire.carries_int(consumers):  # msgpack would refuse it here
            raise ValueError(f"PUT {key!r}: consumers must be a positive int or None, got {consumers!r}")
        return self._client.call("put", [self._key(key), list(Handle.from_wire(handle)), consumers, ttl])

    def get(self, key: str, timeout: float = GET_TIMEOUT_S) -> Handle:
        """The handle under `key` (waiting up to `timeout` s for its PUT); later work on this instance's
        stream waits until the producer's work on it is complete."""
        return self._client.call("get", [self._key(key), timeout], Handle.from_wire).result()

    def delete(self, key: str) -> Future:
        return self._client.call("delete", [self._key(key)])

    # -- low level ----------------------------------------------------------------------------
    def alloc(
        self, nbytes: int | None = None, *, shape: Sequence[int] | None = None, dtype: str = "uint8"
    ) -> Handle:
        """Device memory on the instance's stream (`nbytes`, or a `shape` of `dtype`: one of the two)."""
        if dtype not in DTYPES:
            raise TypeError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
        if (nbytes is None) == (shape is None):
            raise TypeError("alloc takes nbytes or shape, one of the two")
        if shape is None:
            size = _whole(nbytes, "nbytes")
            if size % DTYPES[dtype]:
                raise ValueError(f"alloc of {size} bytes: not a whole number of {dtype} ({DTYPES[dtype]} B)")
            shape = [size // DTYPES[dtype]]
        dims = [_whole(d, "a shape's dimension") for d in shape]
        return self._client.call("alloc", [dtype, dims], Handle.from_wire).result()

    def free(self, handle: Handle) -> Future:
        return self._client.call("free", [list(Handle.from_wire(handle))])

    def memcpy(self, dst: Handle, src: Handle, nbytes: int | None = None) -> Future:
        """Device-to-device copy on the instance's stream."""
        d, s = Handle.from_wire(dst), Handle.from_wire(src)
        return self._client.call("memcpy", [list(d), list(s), nbytes])

    def launch(self, model: str, kernel: int, buffers: dict[str, Handle]) -> Future:
        """Launch kernel number `kernel` of `model`'s plan on the instance's stream; `buffers` binds
        the plan variables the kernel touches (weights are the proxy's) to handles."""
        bound = {name: list(Handle.from_wire(h)) for name, h in buffers.items()}
        return self._client.call("launch", [model, kernel, bound])

    def synchronize(self) -> None:
        """Wait until all work issued on this instance's stream has completed (not device-wide)."""
        self._client.call("synchronize", []).result()

    def plan(self, model: str) -> dict[str, Any]:
        """A loaded model's plan: inputs, outputs, variables and kernels (for `launch`)."""
        return self._client.call("plan", [model]).result()

    def noop_async(self) -> Future:
        return self._client.call("noop", [])

    def noop(self) -> None:
        """A forwarded call that does nothing (round-trip measurements)."""
        self._client.call("noop", []).result()


class _Ended:
    """The client of a `ProxyContext` whose invocation has ended."""

    def __init__(self, ctx: ProxyContext) -> None:
        self._where = f"{ctx.workflow}/{ctx.function}, request {ctx.request_id!r}"

    def call(self, op: str, args: list[Any], convert: Callable[[Any], Any] | None = None) -> Future:
        raise ProxyError(
            f"{op}: the invocation of this ctx ({self._where}) has ended; a thread the handler started "
            "must finish before it returns"
        )


def _is_handle(obj: Any) -> bool:
    if isinstance(obj, Handle):
        return True
    if not isinstance(obj, list | tuple) or len(obj) != 6:
        return False
    return isinstance(obj[0], str) and isinstance(obj[1], int)


#: The largest output a handler may return, in bytes of JSON: outputs travel as events to the next
#: function and back to the caller, so they get the gateway's bound on a request body.
MAX_OUTPUT_BYTES = 64 << 20


def _whole(value: Any, what: str) -> int:
    """`value` as an int if it is one (numpy's too), else `TypeError`: 1.5 bytes is a mistake, not 1."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, got {value!r}") from None


def _as_json(value: Any) -> Any:
    """The handler's output as its caller will see it, JSON's: string keys, no NaN or infinities, no
    device handle, at most `MAX_OUTPUT_BYTES`. Raises `FunctionFailed` saying why not, so that the
    output fails its own request only (a map with integer keys used to reach the gateway and stop
    its reader)."""
    try:
        text = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise FunctionFailed(f"the handler returned a value that is not JSON-able: {exc}") from None
    where = handle_in_json(value, text)
    if where is not None:
        raise FunctionFailed(
            f"the handler returned a device handle ({where}): its memory is the invocation's and is "
            "freed when it ends; return ctx.download(handle).tolist(), or ctx.put it and return the key"
        )
    if len(text) > MAX_OUTPUT_BYTES:
        raise FunctionFailed(
            f"the handler's output is {len(text)} bytes as JSON, more than the bound of {MAX_OUTPUT_BYTES}; "
            "put large data in the store (ctx.put) and return its key"
        )
    # The next function gets the output as its event: the rules of a request's body (docs/workflows.md).
    containers = text.count("[") + text.count("{")
    if containers > wire.MAX_JSON_CONTAINERS:
        raise FunctionFailed(
            f"the handler's output holds about {containers} objects or lists, more than "
            f"{wire.MAX_JSON_CONTAINERS}: put large arrays in the store (ctx.put) and return the key"
        )
    value = json.loads(text)
    if wire.json_depth(value) > wire.MAX_JSON_DEPTH:
        raise FunctionFailed(
            f"the handler's output nests objects or lists more than {wire.MAX_JSON_DEPTH} levels deep"
        )
    return value


def _result(invocation_id: int, output: Any) -> bytes:
    try:
        return wire.pack([wire.RESULT, invocation_id, True, _as_json(output)])
    except OverflowError as exc:  # msgpack carries integers of 64 bits at most
        raise FunctionFailed(f"the handler's output cannot be sent: {exc} (integers are 64-bit)") from None


def serve(
    channel: ClientChannel,
    *,
    instance_id: int,
    workflow: str,
    function: str,
    handler: Callable[[ProxyContext, Any], Any],
    host_memory_mb: int | None = None,
) -> None:
    """An instance's life: register, then run invocations until told to stop (the proxy stops it after
    an invocation that ran out of the `host_memory_mb` it may allocate beyond the template's heap:
    `host_memory`)."""
    if host_memory_mb is not None:
        limit_host_memory(host_memory_mb << 20)
    client = Client(channel)
    channel.send(wire.pack([wire.HELLO, instance_id, os.getpid()]))
    while True:
        message = client.next_message()
        if message[0] == wire.STOP:
            return
        _, invocation_id, request_id, event = message
        ctx = ProxyContext(
            client, workflow=workflow, function=function, request_id=request_id, instance_id=instance_id
        )
        try:
            output = handler(ctx, event)
            ctx._end()
            client.flush()
            reply = _result(invocation_id, output)
        except (Exception, SystemExit) as exc:  # the handler's failure (sys.exit too) fails its request only
            reply = _failure_reply(invocation_id, exc, ctx, client, function, host_memory_mb)
        except BaseException as exc:  # KeyboardInterrupt and the like: the caller is told, then it ends
            with contextlib.suppress(Exception):
                ctx._end()
            # Retired rather than exiting here: the proxy replies once the invocation's device work
            # is done, and an exit before that would fail the request as a crash.
            reply = wire.pack([wire.RESULT, invocation_id, False, [*_failure(exc), wire.RETIRE]])
        channel.send(reply)


def _failure_reply(
    invocation_id: int, exc: BaseException, ctx: ProxyContext, client: Client, function: str,
    host_memory_mb: int | None,
) -> bytes:
    """The reply to a handler's failure. An instance out of host memory (its own, or formatting the
    error found none left) gets room to report it (`allow_report`) and is stopped after it (RETIRE)."""
    out_of_memory = host_memory_mb is not None and out_of_host_memory(exc)
    if out_of_memory:  # what it holds may leave nothing to report with: it ends after this anyway
        allow_report()
    ctx._end()
    try:
        client.flush()
    except Exception as late:  # noqa: BLE001 - reported with the handler's own error
        exc.add_note(f"also: {type(late).__name__}: {late}")
    try:
        failure = _failure(exc)
    except MemoryError:  # e.g. a message of hundreds of MiB copied into its traceback's text
        allow_report()
        failure = [error_type_of(exc), "(not shown: formatting the error ran out of host memory)", ""]
        out_of_memory = True
    if out_of_memory:  # the proxy stops this instance
        note = (
            f"{function}: an instance may allocate {host_memory_mb} MiB of host memory beyond its warm "
            "template's (host_memory_mb); this one is stopped, the next request gets a fresh one"
            if host_memory_mb is not None
            else f"{function}: this instance ran out of host memory; it is stopped, the next request gets a "
            "fresh one"
        )
        failure = [failure[0], f"{failure[1]}\n{note}", f"{failure[2]}{note}\n", wire.RETIRE]
    return wire.pack([wire.RESULT, invocation_id, False, failure])


#: A handler's error message and traceback, each at most this long on the wire (the rest is cut).
MAX_ERROR_CHARS = 16_384


def _failure(exc: BaseException) -> list[str]:
    """[error type, message, traceback] of a handler's failure, each bounded by `MAX_ERROR_CHARS`."""
    message, text = error_message_of(exc), "".join(traceback.format_exception(exc))
    if len(message) > MAX_ERROR_CHARS:
        message = f"{message[:MAX_ERROR_CHARS]}... ({len(message) - MAX_ERROR_CHARS} more characters)"
    if len(text) > MAX_ERROR_CHARS:  # its end says where it was raised
        text = f"({len(text) - MAX_ERROR_CHARS} characters cut) ...{text[-MAX_ERROR_CHARS:]}"
    return [error_type_of(exc), message, text]


Context = ProxyContext  # the name it had before the SDK's `Context` protocol
