"""The gateway: an HTTP server (aiohttp) in front of the workflow engine.

Routes:

- ``POST /workflows/{name}/invoke``: the JSON body is the event of the workflow's entry functions (a
  JPEG/PNG body or a multipart upload becomes one: ``image_input.py``).
  Each request gets a new request id (also in the ``X-Request-Id`` response header) that scopes its
  keys. ``?timeout_ms=`` may shorten the workflow's ``timeout_ms`` (never lengthen it). Answers 200
  with the output and the per-function breakdown, 500 when a function failed, 504 on a timeout (both
  with the same body plus ``error`` and ``failed_call``), 404 for an unknown workflow, 400 for a body
  that is not an event or that a function refused (`streambox.InvalidInput`, with the 500's body),
  503 past the admission limits (below).
- ``GET /workflows``: the deployed workflows (SLO, functions, edges).
- ``GET /healthz``: ``{"status": "ok", "workflows": [...]}``.
- ``GET /metrics``: Prometheus text format (`metrics.py`).

Safety: an event nested deeper than `MAX_JSON_DEPTH` is refused with 400 (not a 500 from the
parser's recursion); at most `max_in_flight` invocations are admitted at once, holding at most
`max_body_bytes_in_flight` bytes of bodies (a body counts at its Content-Length; a chunked or
compressed one, whose size is not known before it is read, at `max_body_bytes`), and one past either
limit is answered 503 with ``Retry-After`` before its body is read (Triton's full queue answers
UNAVAILABLE the same way); a declared body past `max_body_bytes` is answered 413 before it is read;
a body that has not arrived `body_timeout_s` after admission is answered 408 (a client that stops
sending would otherwise hold its admission for ever); a client that goes away cancels its request
(`GatewayServer`: the run ends as a timeout would, and its slot is free once its body's parse, if
one is under way, has ended); with a `token`, every
route but ``/healthz`` wants exactly one ``Authorization: Bearer <token>`` header (401 otherwise); a
connection without a whole request for `idle_timeout_s` (75 s) is closed (`GatewayServer`);
`GatewayServer` binds beyond the loopback interface only with `allow_remote=True`, and warns when
it does (louder without a token). Errors are JSON, each with its own status.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import ClientPayloadError, web
from aiohttp.web_exceptions import HTTPRequestEntityTooLarge
from aiohttp.web_protocol import RequestPayloadError

from streambox.sdk import InvalidInput

from .engine import Engine
from .image_input import MAX_JSON_DEPTH, BodyError, event_from_body, json_depth  # noqa: F401 - re-exported
from .invoker import StatsSource
from .metrics import GatewayMetrics
from .spec import WorkflowSpec

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 64 << 20
#: Invocations admitted at once (reading, parsing or running); more wait in the engine's queues anyway.
DEFAULT_MAX_IN_FLIGHT = 1024
#: Bodies held at once: four of the largest; a decoded event takes a few times its body.
DEFAULT_MAX_BODY_BYTES_IN_FLIGHT = 4 * DEFAULT_MAX_BODY_BYTES
RETRY_AFTER_S = 1  # what a refused caller is told to wait
#: Seconds an admitted body has to arrive in full: minutes of slack for a large image on a slow link.
DEFAULT_BODY_TIMEOUT_S = 60.0
#: Seconds a connection may sit without a whole request (idle between requests, or its headers not
#: ended): nginx's keep-alive default. aiohttp's own, an hour, let idle sockets pile up to the fd limit.
DEFAULT_IDLE_TIMEOUT_S = 75.0
#: At `stop`, how long requests in flight may still finish before they are cancelled (aiohttp's 60 s,
#: then up to 60 s more, kept a `serve` stopping for minutes behind one hung request).
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
OPEN_ROUTES = frozenset({"/healthz"})  # answered without the bearer token
_HTTP_STATUS = {"ok": 200, "error": 500, "timeout": 504}


def _error(
    status: int, message: str, headers: dict[str, str] | None = None, **extra: Any
) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status, headers=headers)


def is_loopback(host: str) -> bool:
    """True for names and addresses that reach only this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Gateway:
    """The HTTP face of an engine whose workflows are deployed (see `GatewayServer` to run it)."""

    def __init__(
        self,
        engine: Engine,
        *,
        stats: StatsSource | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        max_body_bytes_in_flight: int = DEFAULT_MAX_BODY_BYTES_IN_FLIGHT,
        token: str | None = None,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    ) -> None:
        """`token`: when set, callers must send it as a bearer token; `max_in_flight`,
        `max_body_bytes_in_flight` and `body_timeout_s`: the admission limits (module docstring)."""
        if token is not None and len(token) < 16:
            raise ValueError("a gateway token needs at least 16 characters")
        for name, value in (
            ("max_body_bytes", max_body_bytes),
            ("max_in_flight", max_in_flight),
            ("max_body_bytes_in_flight", max_body_bytes_in_flight),
        ):
            if type(value) is not int or value < 1:
                raise ValueError(f"gateway {name} must be a positive integer, got {value!r}")
        if not body_timeout_s > 0:
            raise ValueError(f"gateway body_timeout_s must be a positive number, got {body_timeout_s!r}")
        self.body_timeout_s = float(body_timeout_s)
        self.engine = engine
        self.metrics = GatewayMetrics(stats)
        self.max_body_bytes = max_body_bytes
        self.max_in_flight = max_in_flight
        self.max_body_bytes_in_flight = max_body_bytes_in_flight
        self.token = token
        # Admitted invocations and the body bytes they reserved (the event loop's thread only).
        self._admitted = 0
        self._admitted_bytes = 0

    @web.middleware
    async def _authenticate(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if self.token is not None and request.path not in OPEN_ROUTES:
            sent = request.headers.getall("Authorization", [])
            # Bytes as they came (a header that is not UTF-8 is a wrong token, not a server error);
            # two headers are refused, as a proxy in front might have checked the other one.
            given = sent[0].encode("utf-8", "surrogateescape") if len(sent) == 1 else b""
            if not hmac.compare_digest(given, f"Bearer {self.token}".encode()):
                why = (
                    "more than one Authorization header" if len(sent) > 1
                    else "missing or wrong bearer token"
                )
                return web.json_response(
                    {"error": f"{why} (Authorization: Bearer <token>)"},
                    status=401,
                    headers={"WWW-Authenticate": "Bearer"},
                )
        return await handler(request)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[self._authenticate])
        app.add_routes(
            [
                web.post("/workflows/{name}/invoke", self.invoke),
                web.get("/workflows", self.workflows),
                web.get("/healthz", self.healthz),
                web.get("/metrics", self.metrics_text),
            ]
        )
        return app

    async def invoke(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        spec = self.engine.specs.get(name)
        if spec is None:
            return _error(404, f"unknown workflow {name!r}", workflows=sorted(self.engine.specs))
        declared = request.content_length  # None: no body, or a chunked one (up to the body bound)
        if declared is not None and declared > self.max_body_bytes:
            refusal = _error(413, f"the body declares {declared:,} bytes, more than {self.max_body_bytes:,}")
            refusal.force_close()  # its body, unread, is not the next request
            return refusal
        compressed = request.headers.get("Content-Encoding", "identity").strip().lower() != "identity"
        if declared is None or compressed:  # what it holds once read is known only then
            reserved = self.max_body_bytes if request.body_exists else 0
        else:
            reserved = declared
        refusal = self._refusal(reserved)
        if refusal is not None:
            self.metrics.refused.labels(name).inc()
            return _error(503, refusal, headers={"Retry-After": str(RETRY_AFTER_S)})
        self._admitted += 1
        self._admitted_bytes += reserved
        in_flight = self.metrics.in_flight.labels(name)  # admitted: reading, parsing or running
        in_flight.inc()
        try:
            return await self._invoke_admitted(request, name, spec)
        finally:
            in_flight.dec()
            self._admitted -= 1
            self._admitted_bytes -= reserved

    def _refusal(self, reserved: int) -> str | None:
        """Why an invocation whose body reserves `reserved` bytes is not admitted now (None: it is)."""
        if self._admitted >= self.max_in_flight:
            return (
                f"the gateway is at its limit of {self.max_in_flight} invocations in flight; "
                f"retry in {RETRY_AFTER_S} s"
            )
        if self._admitted and self._admitted_bytes + reserved > self.max_body_bytes_in_flight:
            return (
                f"the gateway holds {self._admitted_bytes:,} bytes of request bodies, and this one "
                f"({reserved:,} bytes) would pass its limit of {self.max_body_bytes_in_flight:,}; "
                f"retry in {RETRY_AFTER_S} s"
            )
        return None

    async def _read_body(self, request: web.Request) -> bytes | web.Response:
        """The whole body, or the error response that says why not (a JSON one, as every other; the
        connection then closes, as what is left of the body on it is unknown)."""
        try:
            async with asyncio.timeout(self.body_timeout_s):
                return await request.read()
        except TimeoutError:
            refusal = _error(408, f"the body did not arrive within {self.body_timeout_s:g} s")
        except HTTPRequestEntityTooLarge:  # a chunked or compressed body that grew past the bound
            refusal = _error(413, f"the body holds more than {self.max_body_bytes:,} bytes")
        except (RequestPayloadError, ClientPayloadError) as error:  # e.g. a corrupt gzip body
            refusal = _error(400, f"the body could not be read: {error}")
        except ConnectionError:  # the client went away: nobody reads the answer (no traceback)
            refusal = _error(400, "the client closed the connection while sending its body")
        refusal.force_close()
        return refusal

    async def _invoke_admitted(self, request: web.Request, name: str, spec: WorkflowSpec) -> web.Response:
        body = await self._read_body(request)
        if isinstance(body, web.Response):
            return body
        # A JSON event, a JPEG/PNG body or a multipart upload (workflows/image_input.py), parsed off
        # the event loop: a large body must not stall other requests.
        parse = asyncio.ensure_future(
            asyncio.to_thread(event_from_body, request.headers.get("Content-Type", ""), body)
        )
        try:
            event = await asyncio.shield(parse)
        except BodyError as error:
            return _error(400, str(error))
        except asyncio.CancelledError:  # the client went away: its admission holds until the parse ends
            await asyncio.wait({parse})
            raise
        timeout_s = spec.timeout_ms / 1e3
        if "timeout_ms" in request.query:
            try:
                asked = float(request.query["timeout_ms"])
            except ValueError:
                asked = -1.0
            if not asked > 0:
                return _error(
                    400, f"timeout_ms must be a positive number, got {request.query['timeout_ms']!r}"
                )
            timeout_s = min(timeout_s, asked / 1e3)
        result = await self.engine.run(name, event, timeout_s=timeout_s)
        self.metrics.observe(result)
        if not result.ok:
            log.warning("workflow %s request %s: %s", name, result.request_id, result.error)
        status = _HTTP_STATUS[result.status]
        if result.error_type == InvalidInput.__name__:  # the handler says the event is wrong
            status = 400
        return web.json_response(result.to_json(), status=status, headers={"X-Request-Id": result.request_id})

    async def workflows(self, request: web.Request) -> web.Response:
        body = {
            name: {
                "description": spec.description,
                "slo_ms": spec.slo_ms,
                "timeout_ms": spec.timeout_ms,
                "functions": {
                    f: {"models": fn.models, "batch_size": fn.batch_size, "max_instances": fn.max_instances}
                    for f, fn in spec.functions.items()
                },
                "edges": [e.model_dump(by_alias=True, exclude_defaults=True) for e in spec.edges],
            }
            for name, spec in self.engine.specs.items()
        }
        return web.json_response(body)

    async def healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "workflows": sorted(self.engine.specs)})

    async def metrics_text(self, request: web.Request) -> web.Response:
        body, content_type = self.metrics.render()
        response = web.Response(body=body)
        response.headers["Content-Type"] = content_type
        return response


def check_bind(host: str, allow_remote: bool) -> None:
    """A host beyond the loopback interface only with `allow_remote` (checked before a deploy too, so
    that the refusal does not wait for it)."""
    if not is_loopback(host) and not allow_remote:
        raise ValueError(
            f"binding the gateway to {host!r} exposes it beyond this machine; pass allow_remote "
            "(`streambox serve --allow-remote`), and set a bearer token (--token-file)"
        )


def check_port_free(host: str, port: int) -> None:
    """`OSError` naming the address if another process listens on it: checked before a deploy (seconds
    of proxy starts), whose proxies a clash found at the bind afterwards started for nothing. Every
    address of `host` is probed as asyncio binds it (IPv6 only on IPv6 sockets, reusable addresses;
    an address family the machine lacks is skipped)."""
    if port == 0:
        return
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
            except OSError as error:
                if error.errno == errno.EADDRNOTAVAIL:
                    continue
                shown = f"[{address[0]}]" if family == socket.AF_INET6 else address[0]
                raise OSError(error.errno, f"cannot listen on {shown}:{port}: {error.strerror}") from None


class GatewayServer:
    """Runs a gateway on host:port (port 0: a free port) inside the running event loop."""

    def __init__(
        self,
        gateway: Gateway,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        allow_remote: bool = False,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
        shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    ) -> None:
        check_bind(host, allow_remote)
        self.idle_timeout_s = idle_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        if not is_loopback(host):
            log.warning(
                "the gateway listens on %s, reachable beyond this machine%s",
                host,
                "" if gateway.token else " and WITHOUT authentication: anyone who reaches it can invoke",
            )
        self.gateway = gateway
        self.host = host
        self.port = port
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> str:
        # A client that goes away cancels its request's handler: the engine ends the run as a timeout
        # would (its invocations and keys dropped), and its admission is free (once a parse under way
        # has ended: `Gateway._invoke_admitted`).
        self._runner = web.AppRunner(
            self.gateway.app(),
            access_log=None,
            handler_cancellation=True,
            keepalive_timeout=self.idle_timeout_s,
            shutdown_timeout=self.shutdown_timeout_s,  # then the requests still running are cancelled
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]  # the bound port (port 0 asks for a free one)
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> GatewayServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
