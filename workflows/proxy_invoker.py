"""`ProxyInvoker`: the workflow engine's `Invoker` over real API proxies (one process per workflow).

- `deploy(spec)` turns the workflow spec into a `ProxyConfig` (handlers, models, batch sizes,
  instance limits, timeouts; the YAML's folder on the template's `sys.path`) and starts the proxy if
  the GPU has room for one more warm proxy without evicting another; otherwise at its first request.
- `invoke` sends the call to the workflow's proxy (starting it if needed) and maps its errors to
  the engine's: a handler that raised or an instance that died -> `InvocationError`, a timeout ->
  `InvocationTimeout`.
- Warm proxies follow `keepalive.WarmProxies`, admitted by memory: a proxy starts on the GPU with the
  most memory free as the node reports it (every process's contexts, pools, weights and other
  jobs) where its footprint fits (`proxy_footprint.py`: predicted from its models' profiles, then
  the larger of that and what it last reported), ties to the GPU with fewer warm proxies, then the
  lowest index. Where none fits, the longest-idle proxies there are evicted first; idle ones stop
  after `keep_alive_s`. A proxy is busy from a request's first call until the request ends, between
  its calls too: the keys its functions PUT for the next ones live in that proxy's store. A workflow
  waiting for room does not starve behind busy ones: after `yield_after_s` they yield
  (`WarmProxies.yields`: no new requests until the waiter is in).
  `max_proxies_per_device` adds a count cap (the paper's 3: `keepalive.PAPER_PROXIES_PER_DEVICE`);
  default none. `placement()` and each proxy's `stats`
  (`device.index`) say where each one runs.
- `runtime_stats()` (the gateway's `/metrics` callback) returns what the proxies reported last; a
  background task refreshes it every `stats_period_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from streambox.api_proxy.control import AsyncProxyClient, ProxyProcess, launch_proxy
from streambox.api_proxy.errors import FunctionFailed, FunctionTimeout, ProxyError
from streambox.api_proxy.function_spec import ProxyFunction
from streambox.api_proxy.keepalive import DEFAULT_KEEP_ALIVE_S, DEFAULT_YIELD_AFTER_S, Admission, WarmProxies
from streambox.api_proxy.proxy_config import ProxyConfig
from streambox.config import Config
from streambox.phases import COLD_START, DEVICE_WAIT, QUEUE

from .invoker import InvocationError, InvocationResult, InvocationTimeout, RuntimeStats, deployed
from .proxy_footprint import predicted_footprint, runtime_overhead
from .spec import WorkflowSpec

log = logging.getLogger(__name__)

#: Extra time the invoker waits for the proxy's answer beyond the invocation's own timeout.
ANSWER_MARGIN_S = 30.0


def proxy_config_for(spec: WorkflowSpec, config: Config, system: str, **options: Any) -> ProxyConfig:
    """The proxy configuration of a workflow spec."""
    functions = tuple(ProxyFunction.of(name, fn, spec.timeout_ms) for name, fn in spec.functions.items())
    sys_path = (str(spec.base_dir.resolve()),) if spec.base_dir is not None else ()
    return ProxyConfig(
        workflow=spec.name,
        functions=functions,
        system=system,
        sys_path=sys_path,
        backend=config.backend,
        device_preset=config.device_preset,
        gpus=config.gpus,
        device_mode=config.device_mode,
        state_dir=str(config.state_dir) if config.state_dir is not None else None,
        model_pool=str(config.model_pool),
        **options,
    )


@dataclass
class _Deployed:
    spec: WorkflowSpec
    config: ProxyConfig
    proxy: ProxyProcess | None = None
    client: AsyncProxyClient | None = None
    starting: asyncio.Future[None] | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    # Requests with a call on the running proxy, until `end_request`: their keys live in its store,
    # so it counts as busy between their calls too and is never evicted under them.
    requests: set[str] = field(default_factory=set)
    # Held by the one request that asks for room on a GPU while the others of the workflow wait on
    # it (each asking would read the node's memory 100 times a second: hundreds of waiting requests
    # saturated the event loop).
    admitting: asyncio.Lock = field(default_factory=asyncio.Lock)
    died_said: ProxyProcess | None = None  # the dead proxy whose death was logged


@dataclass(frozen=True)
class _Detached:
    """A proxy taken off its workflow, to be stopped."""

    client: AsyncProxyClient | None
    proxy: ProxyProcess | None


async def _shut(detached: _Detached) -> None:
    if detached.client is not None:
        detached.client.close()
    if detached.proxy is not None:
        await asyncio.to_thread(detached.proxy.stop)


class ProxyInvoker:
    """Runs a workflow's functions in instances of its API proxy (see the module docstring)."""

    def __init__(
        self,
        config: Config | None = None,
        *,
        system: str = "streambox",
        max_proxies_per_device: int | None = None,
        keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
        yield_after_s: float = DEFAULT_YIELD_AFTER_S,
        stats_period_s: float = 1.0,
        proxy_options: dict[str, Any] | None = None,
    ) -> None:
        self.config = config or Config.from_env()
        self.system = system
        self.proxy_options = dict(proxy_options or {})
        self.proxy_options.setdefault("keep_alive_s", keep_alive_s)
        self.warm = WarmProxies(self.config.gpus, max_proxies_per_device, keep_alive_s, yield_after_s)
        self.stats_period_s = stats_period_s
        self._workflows: dict[str, _Deployed] = {}
        self._housekeeping: asyncio.Task[None] | None = None
        self._closing = False
        self._starts: set[asyncio.Task[None]] = set()  # proxy starts in flight (`_launch`)
        self._backend: Any = None  # opened for the node's free memory, to admit proxies by it
        self._predicted: dict[str, int] = {}  # device bytes of each workflow's proxy, from its profiles
        self._footprints: dict[str, int] = {}  # the larger of that and what its proxy reported last
        self.proxy_starts = 0

    @classmethod
    def factory(cls, **options: Any) -> Any:
        """An `InvokerFactory` for `workflows.commands.serve`: `(config, system) -> ProxyInvoker`."""
        return lambda config, system: cls(config, system=system, **options)

    # -- Invoker ---------------------------------------------------------------------------------
    async def deploy(self, spec: WorkflowSpec) -> None:
        if spec.name in self._workflows:
            return  # deploying again replaces nothing
        config = proxy_config_for(spec, self.config, self.system, **self.proxy_options)
        self._workflows[spec.name] = wf = _Deployed(spec, config)
        self._ensure_housekeeping()
        overhead = runtime_overhead(self.config)
        predicted = await asyncio.to_thread(predicted_footprint, config, overhead)
        self._predicted[spec.name] = self._footprints[spec.name] = predicted
        admission = self._admit(spec.name)
        if not admission.evict and not admission.wait and admission.fits:
            await asyncio.shield(self._launch(wf, admission.device))

    async def pin_warm(self, workflow: str, pinned: bool) -> None:
        """Pause (True) or resume (False) the keep-alive of the workflow's proxy and its instances;
        resuming counts them as used now. For a replay's warm-up: it deploys every workflow before
        its clock starts, and the deploys after one may outlast a time-compressed keep-alive. A
        proxy that is not warm is left alone (pinning does not start it)."""
        wf = deployed(self._workflows, workflow)
        now = time.monotonic()
        if pinned:
            self.warm.pin(workflow)
        else:
            self.warm.unpin(workflow, now)
        if wf.client is not None:
            await wf.client.pin(pinned)

    async def invoke(
        self,
        workflow: str,
        function: str,
        event: dict[str, Any],
        request_id: str,
        *,
        timeout_s: float | None = None,
    ) -> InvocationResult:
        started = time.perf_counter()
        wf = deployed(self._workflows, workflow)
        fn_timeout = wf.config.function(function).timeout_s
        limit = fn_timeout if timeout_s is None else min(fn_timeout, timeout_s)
        proxy_cold = await self._ensure_proxy(wf, new_request=request_id not in wf.requests)
        proxy_start_s = time.perf_counter() - started if proxy_cold else 0.0
        client = wf.client
        assert client is not None
        if request_id not in wf.requests:
            wf.requests.add(request_id)
            self.warm.begin(workflow, time.monotonic())  # ended by `end_request`
        self.warm.begin(workflow, time.monotonic())
        try:
            reply = await client.invoke(function, event, request_id, timeout_s=limit)
        except FunctionTimeout as exc:
            raise InvocationTimeout(f"{function} ran past {limit:.3f} s: {exc}") from None
        except TimeoutError:
            if wf.proxy is not None and not wf.proxy.alive:
                raise InvocationError(function, "ProxyError", f"the proxy of {workflow!r} exited") from None
            raise InvocationTimeout(f"{function}: no answer from the proxy of {workflow!r}") from None
        except FunctionFailed as exc:  # the handler's error, structured (`errors.with_fields`)
            f = exc.fields
            kind, message = f.get("error_type", type(exc).__name__), f.get("message", str(exc))
            raise InvocationError(function, kind, message, f.get("traceback")) from None
        except ProxyError as exc:
            raise InvocationError(function, type(exc).__name__, str(exc)) from None
        finally:  # only on the proxy the call began on: a restarted one's count is its own calls'
            if wf.client is client and workflow in self.warm.warm():
                self.warm.end(workflow, time.monotonic())
        latency_s = time.perf_counter() - started
        phases = dict(reply.get("phases") or {})
        before_run = phases.get(COLD_START, 0.0) + phases.get(QUEUE, 0.0)
        in_call = sum(phases.values()) - before_run - reply["finish_s"]  # measured during the run
        other = {
            "handler": reply["run_s"] - in_call,  # the handler's own code, the channel, dispatcher delays
            "control": latency_s - proxy_start_s - reply["latency_s"],  # the control hop, this invoker
        }
        phases[COLD_START] = phases.get(COLD_START, 0.0) + proxy_start_s  # the proxy's own start too
        cold = bool(reply["cold_start"]) or proxy_cold
        detail = {DEVICE_WAIT: reply.get("device_wait_s", 0.0)}
        return InvocationResult(reply["output"], cold, latency_s, phases, other, detail)

    async def end_request(self, workflow: str, request_id: str) -> None:
        wf = self._workflows.get(workflow)
        if wf is not None and request_id in wf.requests:
            wf.requests.discard(request_id)
            if workflow in self.warm.warm():
                self.warm.end(workflow, time.monotonic())
        if wf is not None and wf.client is not None:
            with contextlib.suppress(Exception):
                await wf.client.end_request(request_id)

    async def close(self) -> None:
        self._closing = True
        if self._housekeeping is not None:
            self._housekeeping.cancel()
            with contextlib.suppress(BaseException):
                await self._housekeeping
        if self._starts:  # let them finish, so that the proxies they start are stopped below
            await asyncio.gather(*self._starts, return_exceptions=True)
        await asyncio.gather(*(self._stop(wf) for wf in self._workflows.values()))
        self._workflows.clear()

    # -- stats -----------------------------------------------------------------------------------
    def runtime_stats(self) -> Iterator[RuntimeStats]:
        """Per warm proxy: device memory, its pool, live instances (as last reported)."""
        for name, wf in self._workflows.items():
            s = wf.stats
            if wf.proxy is None or not wf.proxy.alive or not s:  # a dead proxy's last report is stale
                continue
            device, pool = s["device"], s["pool"]
            yield RuntimeStats(
                workflow=name,
                device=device["index"],
                memory_used_bytes=device["used_bytes"],
                memory_total_bytes=device["total_bytes"],
                pool_reserved_bytes=pool["reserved_bytes"],
                pool_used_bytes=pool["allocated_bytes"],
                instances={fn: v["instances"] for fn, v in s["functions"].items()},
                unprofiled_runs=s.get("profiles", {}).get("unprofiled_runs", 0),
                batches=s.get("batching", {}).get("batches", 0),
                batched_calls=s.get("batching", {}).get("members", 0),
            )

    def placement(self) -> dict[str, int]:
        """The GPU of each warm proxy, by workflow."""
        return {name: self.warm.device_of(name) for name in self.warm.warm()}  # type: ignore[misc]

    def _admit(self, workflow: str) -> Admission:
        """`WarmProxies.admit` with the node's free memory now and the workflow's proxy footprint.
        Synchronous on purpose (a proxy start is rare): no other admission or start can come between
        the memory read and the reservation that follows."""
        free = self._free_memory()
        return self.warm.admit(workflow, time.monotonic(), free, self._footprints.get(workflow, 0))

    def _free_memory(self) -> list[int] | None:
        """Device memory free per GPU of the node (every process's use counted); None when the
        backend reports fewer devices than the node is configured with."""
        gpus = self.config.gpus
        if self._backend is None:
            self._backend = self.config.open_backend()
        usage = self._backend.device_usage()
        return [u.total_memory - u.used_memory for u in usage[:gpus]] if len(usage) >= gpus else None

    def last_stats(self) -> dict[str, dict[str, Any]]:
        """Each warm proxy's last `stats` reply, by workflow (refreshed every `stats_period_s`)."""
        return {name: wf.stats for name, wf in list(self._workflows.items()) if wf.stats}

    async def refresh_stats(self) -> None:
        for wf in list(self._workflows.values()):
            if wf.proxy is not None and not wf.proxy.alive:
                self._note_death(wf, "the next request starts a new proxy")
                wf.stats = {}
                continue
            if wf.client is not None:
                with contextlib.suppress(Exception):
                    wf.stats = await wf.client.stats()
                    # What the proxy holds now (context, weights, its pool) refines the prediction.
                    measured = int(wf.stats["device"]["runtime_bytes"])
                    name = wf.spec.name
                    self._footprints[name] = max(self._predicted.get(name, 0), measured)

    @staticmethod
    def _note_death(wf: _Deployed, then: str) -> None:
        """Log, once, that the workflow's proxy died (its requests in flight failed with ProxyDied)."""
        if wf.proxy is not None and wf.died_said is not wf.proxy:
            wf.died_said = wf.proxy
            log.warning("workflow %s: %s; %s", wf.spec.name, wf.proxy.exit_reason, then)

    # -- proxies ---------------------------------------------------------------------------------
    async def _ensure_proxy(self, wf: _Deployed, new_request: bool = False) -> bool:
        """Make the workflow's proxy warm; True if it had to be started for this call. A request's
        first call waits while the proxy `yields` (its turn is over and another workflow has waited
        as long for room on its GPU): its requests in flight finish, it goes idle, the waiter evicts
        it, and this request asks for room again like any other."""
        while True:  # checked again after each wait: another request may have started it meanwhile
            if wf.client is not None and wf.proxy is not None and wf.proxy.alive:
                if not (new_request and self.warm.yields(wf.spec.name, time.monotonic())):
                    return False
                await asyncio.sleep(0.01)
                continue
            if wf.starting is None and wf.proxy is not None:  # it died: forget it, start a new one
                self._note_death(wf, "starting a new proxy")
                await self._stop(wf)
            if wf.starting is not None:
                await asyncio.shield(wf.starting)
                return True
            async with wf.admitting:  # one request of the workflow asks for room; the others wait here
                while wf.client is None and wf.starting is None:
                    admission = self._admit(wf.spec.name)
                    if not admission.wait:
                        # Give the victims' slots up and take ours with no await in between; a victim is
                        # detached at once (its next request starts or waits for a proxy of its own,
                        # and never calls into the one being stopped, whose slot is gone), its process
                        # stopped by the start's task.
                        victims = [self._detach(self._workflows[victim]) for victim in admission.evict]
                        self._launch(wf, admission.device, victims)
                        break
                    await asyncio.sleep(0.01)  # every proxy on that GPU is busy: wait for one to go idle

    def _launch(self, wf: _Deployed, device: int, victims: Sequence[_Detached] = ()) -> asyncio.Future[None]:
        """Reserve the workflow's slot on `device` and start its proxy (stopping `victims` first) in a
        task of its own; the returned future resolves once it serves, or with the start's error. A
        request that stops waiting (its deadline, a drain) abandons nothing: the start goes on and
        the next request uses the proxy (it used to leave the reservation pending for good, and
        every later request of the workflow waited on it until its own timeout)."""
        self._reserve(wf, device)
        assert wf.starting is not None
        starting = wf.starting
        task = asyncio.get_running_loop().create_task(self._start(wf, device, victims))
        self._starts.add(task)
        task.add_done_callback(self._starts.discard)
        return starting

    def _reserve(self, wf: _Deployed, device: int) -> None:
        """Hold the proxy's GPU slot from its admission on, busy: a concurrent admission counts it and
        cannot evict it while it starts (else a GPU gets more proxies than it allows, and a request
        finds its proxy unregistered). `_launch` does it and starts it."""
        wf.starting = asyncio.get_running_loop().create_future()
        now = time.monotonic()
        self.warm.started(wf.spec.name, device, now, self._footprints.get(wf.spec.name, 0))
        self.warm.begin(wf.spec.name, now, reservation=True)

    async def _start(self, wf: _Deployed, device: int, victims: Sequence[_Detached]) -> None:
        """Stop `victims`, launch the proxy; reports through `wf.starting` (never raises)."""
        assert wf.starting is not None, "_reserve first"
        name = wf.spec.name
        try:
            for victim in victims:
                await _shut(victim)
            config = wf.config.with_overrides(device=device)
            wf.proxy = await asyncio.to_thread(launch_proxy, config)
            wf.client = AsyncProxyClient(wf.proxy.address)
            self.proxy_starts += 1
            self.warm.ready(name)  # its memory now shows in what the device reports
            wf.starting.set_result(None)
        except Exception as exc:
            self.warm.remove(name)
            wf.starting.set_exception(exc)
            wf.starting.exception()  # retrieved: waiters re-raise it
        except BaseException:  # cancelled (the loop is closing): waiters are cancelled too
            self.warm.remove(name)
            wf.starting.cancel()
            raise
        finally:
            wf.starting = None
            if name in self.warm.warm():
                self.warm.end(name, time.monotonic())

    async def _stop(self, wf: _Deployed) -> None:
        await _shut(self._detach(wf))

    def _detach(self, wf: _Deployed) -> _Detached:
        """Take the workflow's proxy off it and off the warm list (synchronously): what `_shut` stops."""
        self.warm.remove(wf.spec.name)
        detached = _Detached(wf.client, wf.proxy)
        wf.client = wf.proxy = None
        wf.stats = {}
        wf.requests.clear()  # their keys go with the proxy
        return detached

    def _ensure_housekeeping(self) -> None:
        if self._housekeeping is None or self._housekeeping.done():
            self._closing = False
            self._housekeeping = asyncio.get_running_loop().create_task(self._housekeep())

    async def _housekeep(self) -> None:
        while not self._closing:  # `close` also cancels it; this ends it should an await swallow that
            await asyncio.sleep(self.stats_period_s)
            for name in self.warm.expired(time.monotonic()):
                await self._stop(self._workflows[name])
            await self.refresh_stats()
