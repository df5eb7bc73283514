"""What the `streambox` command line calls for workflows: validate, serve, invoke, run-local.

Every function raises an exception whose `str()` is the one line (or, for validation, the lines) to
show the user: `WorkflowValidationError` (a ValueError), `GatewayUnreachable`, `ValueError`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from streambox.api_proxy.proxy_config import ablation_options
from streambox.config import Config, env_default
from streambox.flags import MECHANISMS, RUN, given_settings

from .engine import Engine, RequestResult
from .examples import EXAMPLES, SMALL_PARAMS, example_path
from .gateway import Gateway, GatewayServer, check_bind, check_port_free
from .image_input import load_event_json
from .invoker import Invoker, StatsSource
from .local import LocalInvoker
from .spec import WorkflowSpec
from .validation import validate_file

log = logging.getLogger(__name__)

DEFAULT_PORT = 8080
DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"

#: Builds the invoker `serve` runs functions through, from the configuration and the system
#: ("streambox" or "stream-only"). The API proxy provides one; the default is run-local.
InvokerFactory = Callable[[Config, str], Invoker]


class GatewayUnreachable(RuntimeError):
    """No gateway answers at the URL."""


def resolve_workflow_path(path_or_example: str | Path) -> Path:
    """A YAML path, or the name of a bundled example (`traffic`, `image-processing`, ...)."""
    known = ", ".join(EXAMPLES)
    if not str(path_or_example).strip():
        raise ValueError(f"an empty name: give a workflow YAML file or a bundled workflow ({known})")
    path = Path(path_or_example)
    if not path.exists() and str(path_or_example) in EXAMPLES:
        return example_path(str(path_or_example))
    if path.is_symlink() and not path.exists():
        raise ValueError(f"{path}: a symbolic link to nothing (or a loop of links)")
    if not path.exists():
        raise ValueError(f"{path}: no such file, and no bundled workflow of that name ({known})")
    return path


def load_specs(paths: Sequence[str | Path], *, small: bool = False) -> list[WorkflowSpec]:
    """Validate every file before anything starts; raises `WorkflowValidationError`. `small`: the
    bundled workflows run at the zoo's small input sizes (`examples.SMALL_PARAMS`)."""
    specs = [validate_file(resolve_workflow_path(p)) for p in paths]
    if small:
        specs = [s.with_params(SMALL_PARAMS[s.name]) if s.name in SMALL_PARAMS else s for s in specs]
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"two workflow files share the name(s) {', '.join(duplicates)}")
    return specs


def _local_invoker(config: Config, system: str) -> LocalInvoker:
    return LocalInvoker.open(config, system=system)


async def _watch(stop: threading.Event, finished: asyncio.Event) -> None:
    while not stop.is_set():
        await asyncio.sleep(0.05)
    finished.set()


async def serve_async(
    specs: Sequence[WorkflowSpec],
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    config: Config | None = None,
    system: str = "streambox",
    invoker_factory: InvokerFactory | None = None,
    stats: StatsSource | None = None,
    on_ready: Callable[[str], None] | None = None,
    stop: threading.Event | None = None,
    allow_remote: bool = False,
    token: str | None = None,
    gateway_options: Mapping[str, int] | None = None,
) -> None:
    """Deploy the workflows and serve them until `stop` is set or SIGINT/SIGTERM arrives.
    `gateway_options`: the gateway's limits (`Gateway`'s `max_in_flight`, `max_body_bytes_in_flight`)."""
    check_bind(host, allow_remote)  # before any deploy, which takes seconds
    check_port_free(host, port)
    config = config or Config.from_env()
    invoker = (invoker_factory or _local_invoker)(config, system)
    if stats is None:
        stats = getattr(invoker, "runtime_stats", None)
    engine = Engine(invoker)
    try:
        for spec in specs:
            await engine.deploy(spec)
        gateway = Gateway(engine, stats=stats, token=token, **(gateway_options or {}))
        async with GatewayServer(gateway, host, port, allow_remote=allow_remote) as server:
            finished = asyncio.Event()
            loop = asyncio.get_running_loop()
            if threading.current_thread() is threading.main_thread():
                stopper = _stopper(finished, server.shutdown_timeout_s)
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(sig, stopper, sig)
            watcher = asyncio.create_task(_watch(stop, finished)) if stop is not None else None
            log.info("serving %s at %s", ", ".join(s.name for s in specs), server.url)
            if on_ready is not None:
                on_ready(server.url)
            await finished.wait()
            if watcher is not None:
                watcher.cancel()
    finally:
        await engine.close()


def _stopper(finished: asyncio.Event, grace_s: float) -> Callable[[int], None]:
    """The SIGINT/SIGTERM handler of `serve` (called with the signal): the first stops it (requests in
    flight get `grace_s` to finish, then are cancelled and their invocations stopped); a second one
    exits at once (the proxies, whose parent is gone, stop by themselves and clean up)."""
    received = 0

    def on_signal(signum: int) -> None:
        nonlocal received
        received += 1
        if received == 1:
            log.warning("stopping: requests in flight get up to %g s to finish (again: at once)", grace_s)
            finished.set()
            return
        log.warning("stopping at once")
        logging.shutdown()
        os._exit(128 + signum)

    return on_signal


def serve(
    paths: Sequence[str | Path],
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    backend: str | None = None,
    system: str = "streambox",
    config: Config | None = None,
    invoker_factory: InvokerFactory | None = None,
    on_ready: Callable[[str], None] | None = None,
    stop: threading.Event | None = None,
    small: bool = False,
    allow_remote: bool = False,
    token: str | None = None,
    gateway_options: Mapping[str, int] | None = None,
) -> None:
    """`streambox serve WORKFLOW.yaml... [--backend emulated|cuda] [--system streambox|stream-only]`:
    validate the files, deploy them, and serve the gateway until interrupted."""
    specs = load_specs(paths, small=small)
    config = (config or Config.from_env()).with_overrides(backend=backend)
    asyncio.run(
        serve_async(
            specs,
            host=host,
            port=port,
            config=config,
            system=system,
            invoker_factory=invoker_factory,
            on_ready=on_ready,
            stop=stop,
            allow_remote=allow_remote,
            token=token,
            gateway_options=gateway_options,
        )
    )


def proxy_options_from(args: argparse.Namespace) -> dict[str, Any]:
    """The `ProxyConfig` fields the settings flags set (`streambox.flags`: the mechanisms, completion,
    channel, and `inputs` as the shapes the proxy loads its models for); a bad value raises
    `SettingsError` naming it. For `ProxyInvoker.factory(proxy_options=...)`."""
    options = ablation_options(given_settings(args, MECHANISMS, RUN))
    inputs = options.pop("inputs", None)
    return {**options, "model_shapes": inputs} if inputs is not None else options


def inputs_from(args: argparse.Namespace) -> str:
    """`--inputs` (or its deprecated alias), else the environment's (`STREAMBOX_INPUTS`), else small."""
    return str(args.inputs or env_default("inputs"))


def load_event(path: str | Path) -> dict[str, Any]:
    """An event from a JSON file: an object, under the gateway's rules for a request body (no NaN, no
    integer past 64 bits, bounded nesting), so that a file the gateway would refuse is refused here,
    naming the file; `ValueError` otherwise."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"{path}: {error.strerror or error}") from None
    return load_event_json(data, str(path))  # its BodyError is a ValueError naming the file


@dataclass(frozen=True)
class InvokeResponse:
    http_status: int
    body: dict[str, Any]

    @property
    def ok(self) -> bool:
        return self.http_status == 200


async def invoke_async(
    name: str,
    event: dict[str, Any],
    *,
    url: str = DEFAULT_URL,
    timeout_s: float | None = None,
    token: str | None = None,
) -> InvokeResponse:
    target = f"{url.rstrip('/')}/workflows/{name}/invoke"
    client_timeout = aiohttp.ClientTimeout(total=timeout_s)
    headers = {"Authorization": f"Bearer {token}"} if token else None
    try:
        async with (
            aiohttp.ClientSession(timeout=client_timeout) as session,
            session.post(target, json=event, headers=headers) as response,
        ):
            try:
                body = await response.json(content_type=None)
            except (json.JSONDecodeError, aiohttp.ContentTypeError):
                body = {"error": (await response.text())[:500]}
            return InvokeResponse(response.status, body if isinstance(body, dict) else {"body": body})
    except aiohttp.ClientConnectionError as error:
        raise GatewayUnreachable(f"cannot reach the gateway at {url}: {error}") from None
    except TimeoutError:
        raise GatewayUnreachable(f"no answer from the gateway at {url} within {timeout_s} s") from None


def invoke(
    name: str,
    event: dict[str, Any],
    *,
    url: str = DEFAULT_URL,
    timeout_s: float | None = None,
    token: str | None = None,
) -> InvokeResponse:
    """`streambox invoke NAME --input FILE [--url URL] [--token-file PATH]`: one request through a
    running gateway (with its bearer token, when it wants one)."""
    return asyncio.run(invoke_async(name, event, url=url, timeout_s=timeout_s, token=token))


async def run_local_async(
    spec: WorkflowSpec, events: Sequence[dict[str, Any]], invoker: Invoker, *, concurrency: int = 1
) -> list[RequestResult]:
    engine = Engine(invoker)
    try:
        await engine.deploy(spec)
        gate = asyncio.Semaphore(concurrency)

        async def one(event: dict[str, Any]) -> RequestResult:
            async with gate:
                return await engine.run(spec.name, event)

        return list(await asyncio.gather(*(one(e) for e in events)))
    finally:
        await engine.close()


def run_local(
    path: str | Path,
    events: Sequence[dict[str, Any]],
    *,
    backend: str | None = None,
    system: str = "streambox",
    config: Config | None = None,
    concurrency: int = 1,
    small: bool = False,
) -> list[RequestResult]:
    """`streambox run-local WORKFLOW.yaml --input FILE`: requests in this process, no HTTP, on a
    runtime of the configured backend (the embedded mode, `local.py`)."""
    (spec,) = load_specs([path], small=small)
    config = (config or Config.from_env()).with_overrides(backend=backend)
    invoker = LocalInvoker.open(config, system=system)
    return asyncio.run(run_local_async(spec, events, invoker, concurrency=concurrency))
