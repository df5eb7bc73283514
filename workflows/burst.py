"""`streambox burst WORKFLOW.yaml`: deploy a workflow on a real API proxy, send a burst of requests
and report latency, cold starts and memory.

The workflow runs on `ProxyInvoker` (one proxy process per workflow, functions as instances of it on
the configured backend; the emulated GPU by default). Requests go either through the real HTTP
gateway (`via="gateway"`, the default: started on a free local port, `POST /workflows/{name}/invoke`
with an aiohttp client, `GET /metrics` read at the end) or straight to the `Engine`
(`via="engine"`: no HTTP). At most `concurrency` requests are outstanding at any time.

The report: requests ok/failed, end-to-end latency percentiles (as the client saw them), cold starts
(proxy starts, function instance starts), a per-function breakdown from the engine's call records,
and device memory and the workflow's pool (last reading, and the peak of the readings sampled while
the burst ran).

`inputs` (`--inputs small|full`, as for `serve` and `replay`): `small` runs the bundled workflows at
the zoo's small input shapes (`examples.SMALL_PARAMS`, the default), `full` at their YAML's sizes.
`params` (`--params [FUNCTION.]KEY=VALUE`) then override functions' YAML `params` (the engine hands a
function's params to it in every event, so they size the work: image sizes, fan-out widths). A KEY
without FUNCTION goes to every function whose YAML declares it, or else to the entry functions.

The command line (`streambox.cli`) builds its flags from the settings tree; the device runs `timed`
unless `--device-mode` or `STREAMBOX_DEVICE_MODE` says otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from streambox.api_proxy.errors import ProxyError
from streambox.api_proxy.proxy_config import SYSTEMS
from streambox.config import INPUTS, Config
from streambox.flags import config_from
from streambox.phases import PHASES

from .commands import inputs_from, load_event, load_specs, proxy_options_from
from .engine import Engine
from .examples import EXAMPLES, SMALL_PARAMS, sample_event
from .gateway import Gateway, GatewayServer
from .invoker import RuntimeStats
from .proxy_invoker import ProxyInvoker
from .spec import WorkflowSpec

VIAS = ("gateway", "engine")


# -- inputs ---------------------------------------------------------------------------------------
def _value(text: str) -> Any:
    """`128` -> 128, `0.5` -> 0.5, `true` -> True, `[1, 2]` -> [1, 2]; anything else stays text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_params(pairs: Sequence[str] | None, spec: WorkflowSpec) -> dict[str, dict[str, Any]]:
    """`[FUNCTION.]KEY=VALUE` items as `WorkflowSpec.with_params` takes them (see the module doc)."""
    out: dict[str, dict[str, Any]] = {}
    entries = spec.graph().entries
    for pair in pairs or ():
        key, sep, text = pair.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"--params takes [FUNCTION.]KEY=VALUE, got {pair!r}")
        function, dot, name = key.rpartition(".")
        if not name:
            raise ValueError(f"--params {pair!r}: the KEY after {function + '.'!r} is empty")
        if dot and function not in spec.functions:
            known = ", ".join(spec.functions)
            raise ValueError(
                f"--params {pair!r}: workflow {spec.name!r} has no function {function!r} ({known})"
            )
        if dot:
            targets = [function]
        else:
            targets = [f for f, fn in spec.functions.items() if name in fn.params] or list(entries)
        value = _value(text.strip())
        for target in targets:
            _check_kind(pair, f"{target}.{name}", spec.functions[target].params.get(name), value)
            out.setdefault(target, {})[name] = value
    return out


def _check_kind(pair: str, where: str, current: Any, value: Any) -> None:
    """An override of a param the workflow sets must be of the same kind (a number for a number)."""
    if current is None or _kind(value) == _kind(current):
        return
    quote = " (VALUE is read as JSON: quote text, as KEY='\"123\"')" if isinstance(current, str) else ""
    raise ValueError(
        f"--params {pair!r}: {where} is {_kind(current)} in the workflow ({current!r}); "
        f"got {_kind(value)} {value!r}{quote}"
    )


def _kind(value: Any) -> str:
    """A param value's kind as a workflow author reads it (an int and a float are both numbers)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "text"
    return "a list" if isinstance(value, list) else "a mapping"


def resolve_params(
    spec: WorkflowSpec, pairs: Sequence[str] | None = None, *, inputs: str = "small"
) -> WorkflowSpec:
    """The spec at `inputs` sizes (`small`: `SMALL_PARAMS`), then with the `--params` items applied."""
    if inputs not in INPUTS:
        raise ValueError(f"inputs {inputs!r} is not one of {', '.join(INPUTS)}")
    if inputs == "small" and spec.name in SMALL_PARAMS:
        spec = spec.with_params(SMALL_PARAMS[spec.name])
    return spec.with_params(parse_params(pairs, spec))


def default_events(spec: WorkflowSpec, count: int) -> list[dict[str, Any]]:
    """Seeded synthetic requests (request i: seed i) for a bundled workflow; `{}` for others."""
    if spec.name not in EXAMPLES:
        return [{} for _ in range(count)]
    return [sample_event(spec.name, seed) for seed in range(count)]


# -- results --------------------------------------------------------------------------------------
def _percentiles_ms(seconds: Sequence[float]) -> dict[str, float | None]:
    if not seconds:
        return dict.fromkeys(("p50", "p90", "p99", "mean", "max"))
    ms = np.asarray(seconds, dtype=float) * 1e3
    p50, p90, p99 = (round(float(v), 3) for v in np.percentile(ms, [50, 90, 99]))
    return {
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "mean": round(float(ms.mean()), 3),
        "max": round(float(ms.max()), 3),
    }


@dataclass
class Outcome:
    """One request as the client saw it, with the engine's answer (`RequestResult.to_json()`)."""

    latency_s: float  # client side: from sending to the answer (HTTP included via the gateway)
    status: str  # ok | error | timeout | http-<code>
    body: dict[str, Any]

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def calls(self) -> list[dict[str, Any]]:
        return list(self.body.get("calls", []))


@dataclass
class Memory:
    """Device memory and the workflow's pool, summed over the devices its proxy uses."""

    device_used_bytes: int = 0
    device_total_bytes: int = 0
    pool_reserved_bytes: int = 0
    pool_used_bytes: int = 0
    instances: dict[str, int] = field(default_factory=dict)
    batches: int = 0  # batched inferences (docs/workflows.md, "Batching"): in a report, the burst's
    batched_calls: int = 0  # the calls they served

    @classmethod
    def of(cls, rows: Sequence[RuntimeStats], workflow: str) -> Memory:
        devices: dict[int, tuple[int, int]] = {}
        memory = cls()
        for row in rows:
            devices[row.device] = (row.memory_used_bytes, row.memory_total_bytes)
            if row.workflow == workflow:
                memory.pool_reserved_bytes += row.pool_reserved_bytes
                memory.pool_used_bytes += row.pool_used_bytes
                for function, count in row.instances.items():
                    memory.instances[function] = memory.instances.get(function, 0) + count
                memory.batches = max(memory.batches, row.batches)  # per workflow, on each of its rows
                memory.batched_calls = max(memory.batched_calls, row.batched_calls)
        memory.device_used_bytes = sum(u for u, _ in devices.values())
        memory.device_total_bytes = sum(t for _, t in devices.values())
        return memory

    @classmethod
    def from_metrics(cls, text: str, workflow: str) -> Memory:
        """The gateway's `/metrics` gauges (Prometheus text format)."""
        from prometheus_client.parser import text_string_to_metric_families

        memory = cls()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels, value = sample.labels, int(sample.value)
                if sample.name == "streambox_device_memory_used_bytes":
                    memory.device_used_bytes += value
                elif sample.name == "streambox_device_memory_total_bytes":
                    memory.device_total_bytes += value
                elif labels.get("workflow") != workflow:
                    continue
                elif sample.name == "streambox_pool_reserved_bytes":
                    memory.pool_reserved_bytes += value
                elif sample.name == "streambox_pool_used_bytes":
                    memory.pool_used_bytes += value
                elif sample.name == "streambox_function_instances":
                    function = labels["function"]
                    memory.instances[function] = memory.instances.get(function, 0) + value
                elif sample.name == "streambox_batches_total":
                    memory.batches = value
                elif sample.name == "streambox_batched_calls_total":
                    memory.batched_calls = value
        return memory

    def peak(self, other: Memory) -> Memory:
        return Memory(
            max(self.device_used_bytes, other.device_used_bytes),
            max(self.device_total_bytes, other.device_total_bytes),
            max(self.pool_reserved_bytes, other.pool_reserved_bytes),
            max(self.pool_used_bytes, other.pool_used_bytes),
            {
                f: max(self.instances.get(f, 0), other.instances.get(f, 0))
                for f in {*self.instances, *other.instances}
            },
            max(self.batches, other.batches),
            max(self.batched_calls, other.batched_calls),
        )


@dataclass
class BurstReport:
    workflow: str
    system: str
    via: str
    concurrency: int
    params: dict[str, dict[str, Any]]
    outcomes: list[Outcome]
    wall_s: float  # from the first request sent to the last answer
    deploy_s: float  # deploying the workflow (starting its proxy when the GPU has room)
    proxy_starts: int
    memory: Memory  # after the burst
    peak_memory: Memory  # the largest readings sampled during it
    warmup: int = 0  # requests sent before `outcomes` and left out of them
    proxy_options: dict[str, Any] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)  # the proxy's resolved tree (its `stats`)
    # The proxy's GPU and its store as its `stats` reported last (moves per destination with --gpus N).
    gpu: int | None = None
    store: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> int:
        return sum(o.ok for o in self.outcomes)

    @property
    def failed(self) -> int:
        return len(self.outcomes) - self.ok

    @property
    def instance_starts(self) -> int:
        """Function invocations that started a new instance (its first call on a fresh proxy too)."""
        return sum(bool(c.get("cold_start")) for o in self.outcomes for c in o.calls)

    def latency_ms(self) -> dict[str, float | None]:
        """Percentiles of the successful requests' end-to-end latency."""
        return _percentiles_ms([o.latency_s for o in self.outcomes if o.ok])

    def functions(self) -> dict[str, dict[str, Any]]:
        """Per function: invocations, instance starts, latency as the invoker measured it, queueing."""
        calls: dict[str, list[dict[str, Any]]] = {}
        for outcome in self.outcomes:
            for call in outcome.calls:
                calls.setdefault(call["function"], []).append(call)
        out = {}
        for function, rows in calls.items():
            seconds = [c["latency_ms"] / 1e3 for c in rows if c.get("latency_ms") is not None]
            queued = [c.get("queued_ms", 0.0) for c in rows]
            out[function] = {
                "invocations": len(rows),
                "failed": sum(c.get("status") != "ok" for c in rows),
                "cold_starts": sum(bool(c.get("cold_start")) for c in rows),
                "latency_ms": _percentiles_ms(seconds),
                "queued_ms_mean": round(sum(queued) / len(queued), 3) if queued else 0.0,
            }
        return out

    def phases_ms(self) -> dict[str, float]:
        """Mean ms per phase of the successful requests (`RequestResult.phases`: along each request's
        critical path, adding up to its engine latency) and `client`, the rest of the client's latency
        (HTTP and the gateway via the gateway); the means add up to the mean latency."""
        rows = [(o.latency_s * 1e3, o.body.get("phases_ms") or {}) for o in self.outcomes if o.ok]
        rows = [(ms, p) for ms, p in rows if p]
        if not rows:
            return {}
        out = {phase: sum(p.get(phase, 0.0) for _, p in rows) / len(rows) for phase in PHASES}
        out["client"] = sum(ms - sum(p.values()) for ms, p in rows) / len(rows)
        return {phase: round(ms, 3) for phase, ms in out.items()}

    def other_ms(self, key: str = "other_ms") -> dict[str, float]:
        """Mean ms of the `other` phase by where it went (`RequestResult.other`), or of the phases'
        details with `key="detail_ms"` (`RequestResult.detail`)."""
        rows = [o.body.get(key) or {} for o in self.outcomes if o.ok]
        rows = [r for r in rows if r]
        parts = sorted({part for r in rows for part in r})
        return {part: round(sum(r.get(part, 0.0) for r in rows) / len(rows), 3) for part in parts}

    def errors(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for outcome in self.outcomes:
            if not outcome.ok:
                message = str(outcome.body.get("error", outcome.status))
                counts[message] = counts.get(message, 0) + 1
        return counts

    def to_json(self) -> dict[str, Any]:
        return {
            "workflow": self.workflow,
            "system": self.system,
            "via": self.via,
            "requests": len(self.outcomes),
            "warmup": self.warmup,
            "concurrency": self.concurrency,
            "params": self.params,
            "proxy_options": self.proxy_options,
            "settings": self.settings,
            "gpu": self.gpu,
            "store": self.store,
            "ok": self.ok,
            "failed": self.failed,
            "errors": self.errors(),
            "wall_s": round(self.wall_s, 3),
            "throughput_rps": round(len(self.outcomes) / self.wall_s, 3) if self.wall_s > 0 else None,
            "deploy_s": round(self.deploy_s, 3),
            "latency_ms": self.latency_ms(),
            "phases_ms": self.phases_ms(),
            "other_ms": self.other_ms(),
            "detail_ms": self.other_ms("detail_ms"),
            "proxy_starts": self.proxy_starts,
            "instance_starts": self.instance_starts,
            "functions": self.functions(),
            "memory": asdict(self.memory),
            "peak_memory": asdict(self.peak_memory),
            "latencies_ms": [round(o.latency_s * 1e3, 3) for o in self.outcomes],
        }


# -- running --------------------------------------------------------------------------------------
class Deployment:
    """A workflow deployed on its own `ProxyInvoker` behind a gateway on a free local port; bursts
    of requests go through the gateway (`via="gateway"`) or straight to the engine. Use it as an
    async context manager: entering deploys (starting the proxy), leaving stops everything."""

    def __init__(
        self,
        spec: WorkflowSpec,
        *,
        via: str = "gateway",
        system: str = "streambox",
        config: Config | None = None,
        proxy_options: Mapping[str, Any] | None = None,
        stats_period_s: float = 0.25,
    ) -> None:
        if via not in VIAS:
            raise ValueError(f"via must be one of {', '.join(VIAS)}, got {via!r}")
        if system not in SYSTEMS:
            raise ValueError(f"system must be one of {', '.join(SYSTEMS)}, got {system!r}")
        self.spec = spec
        self.via = via
        self.system = system
        self.proxy_options = dict(proxy_options or {})
        self.stats_period_s = stats_period_s
        self.invoker = ProxyInvoker(
            config or Config.from_env(),
            system=system,
            stats_period_s=stats_period_s,
            proxy_options=self.proxy_options,
        )
        self.engine = Engine(self.invoker)
        self.deploy_s = 0.0
        self._server: GatewayServer | None = None
        self._session: aiohttp.ClientSession | None = None
        self._proxy_starts_reported = 0

    async def __aenter__(self) -> Deployment:
        try:
            started = time.perf_counter()
            await self.engine.deploy(self.spec)
            self.deploy_s = time.perf_counter() - started
            self._server = GatewayServer(Gateway(self.engine, stats=self.invoker.runtime_stats))
            await self._server.start()
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._server is not None:
            await self._server.stop()
            self._server = None
        await self.engine.close()

    @property
    def url(self) -> str:
        assert self._server is not None, "enter the deployment first"
        return self._server.url

    async def send(self, event: dict[str, Any]) -> Outcome:
        """One request; the latency is the client's (HTTP included via the gateway)."""
        started = time.perf_counter()
        if self.via == "engine":
            result = await self.engine.run(self.spec.name, event)
            return Outcome(time.perf_counter() - started, result.status, result.to_json())
        assert self._session is not None, "enter the deployment first"
        async with self._session.post(
            f"{self.url}/workflows/{self.spec.name}/invoke", json=event
        ) as response:
            text = await response.text()
        latency = time.perf_counter() - started
        try:
            body = json.loads(text)
        except json.JSONDecodeError:
            body = {"error": text[:500]}
        body = body if isinstance(body, dict) else {"body": body}
        # 400 with a body: a function refused the event (`streambox.InvalidInput`), an error like 500's.
        status = str(body.get("status", "")) if response.status in (200, 400, 500, 504) else ""
        if status not in ("ok", "error", "timeout") or (status == "ok") != (response.status == 200):
            status = f"http-{response.status}"
        return Outcome(latency, status, body)

    async def memory(self) -> Memory:
        """Memory now: the proxies are asked for fresh stats; via the gateway, read from `/metrics`."""
        await self.invoker.refresh_stats()
        if self.via == "engine":
            return Memory.of(list(self.invoker.runtime_stats()), self.spec.name)
        assert self._session is not None, "enter the deployment first"
        async with self._session.get(f"{self.url}/metrics") as response:
            return Memory.from_metrics(await response.text(), self.spec.name)

    async def _sample(self, peak: list[Memory]) -> None:
        while True:
            peak[0] = peak[0].peak(Memory.of(list(self.invoker.runtime_stats()), self.spec.name))
            await asyncio.sleep(self.stats_period_s)

    async def burst(
        self, events: Sequence[dict[str, Any]], *, concurrency: int = 4, warmup: int = 0
    ) -> BurstReport:
        """`events[:warmup]` one at a time (left out of the report), then the rest with at most
        `concurrency` outstanding. Proxy starts: those since the previous report (deploy included)."""
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        if not 0 <= warmup < len(events):
            raise ValueError(f"need more events ({len(events)}) than warm-up requests ({warmup})")
        for event in events[:warmup]:
            await self.send(event)
        before = await self.memory()  # the batching counters so far (warm-up, earlier bursts)
        gate = asyncio.Semaphore(concurrency)

        async def gated(event: dict[str, Any]) -> Outcome:
            async with gate:
                return await self.send(event)

        peak = [Memory()]
        sampler = asyncio.create_task(self._sample(peak))
        try:
            started = time.perf_counter()
            outcomes = list(await asyncio.gather(*(gated(e) for e in events[warmup:])))
            wall_s = time.perf_counter() - started
        finally:
            sampler.cancel()
        memory = _batching_since(await self.memory(), before)
        last = self.invoker.last_stats().get(self.spec.name, {})
        starts, self._proxy_starts_reported = (
            self.invoker.proxy_starts - self._proxy_starts_reported,
            self.invoker.proxy_starts,
        )
        return BurstReport(
            workflow=self.spec.name,
            system=self.system,
            via=self.via,
            concurrency=concurrency,
            params={f: dict(fn.params) for f, fn in self.spec.functions.items() if fn.params},
            outcomes=outcomes,
            wall_s=wall_s,
            deploy_s=self.deploy_s,
            proxy_starts=starts,
            memory=memory,
            peak_memory=peak[0].peak(memory),
            warmup=warmup,
            proxy_options=self.proxy_options,
            settings=dict(last.get("settings", {})),
            gpu=last.get("device", {}).get("index"),
            store=dict(last.get("store", {})),
        )


def _batching_since(now: Memory, before: Memory) -> Memory:
    """`now` with its batching counters counted from `before` (a proxy that restarted meanwhile counts
    from zero: its counters went down)."""
    if now.batches < before.batches or now.batched_calls < before.batched_calls:
        return now
    calls = now.batched_calls - before.batched_calls
    return replace(now, batches=now.batches - before.batches, batched_calls=calls)


async def burst_async(
    spec: WorkflowSpec,
    events: Sequence[dict[str, Any]],
    *,
    concurrency: int = 4,
    warmup: int = 0,
    **options: Any,
) -> BurstReport:
    """Deploy `spec` (`options`: `Deployment`'s), run one burst of `events`, stop everything."""
    async with Deployment(spec, **options) as deployment:
        return await deployment.burst(events, concurrency=concurrency, warmup=warmup)


def prepare(
    path: str | Path,
    *,
    requests: int,
    warmup: int = 0,
    input_path: str | Path | None = None,
    params: Sequence[str] | None = None,
    inputs: str = "small",
) -> tuple[WorkflowSpec, list[dict[str, Any]]]:
    """The validated spec (with its params resolved) and `warmup + requests` events."""
    if requests < 1:
        raise ValueError(f"--requests must be at least 1, got {requests}")
    if warmup < 0:
        raise ValueError(f"--warmup must be at least 0, got {warmup}")
    (spec,) = load_specs([path])
    spec = resolve_params(spec, params, inputs=inputs)
    count = warmup + requests
    events = [load_event(input_path)] * count if input_path is not None else default_events(spec, count)
    return spec, events


def burst(
    path: str | Path,
    *,
    requests: int = 16,
    concurrency: int = 4,
    warmup: int = 0,
    input_path: str | Path | None = None,
    params: Sequence[str] | None = None,
    inputs: str = "small",
    **options: Any,
) -> BurstReport:
    """Blocking `burst_async` of a YAML file (or bundled workflow name); `options` go to it."""
    spec, events = prepare(
        path, requests=requests, warmup=warmup, input_path=input_path, params=params, inputs=inputs
    )
    return asyncio.run(burst_async(spec, events, concurrency=concurrency, warmup=warmup, **options))


# -- printing -------------------------------------------------------------------------------------
def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):,.1f} MiB"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _mechanisms(settings: dict[str, Any]) -> str:
    """The resolved tree in one line: pool mode, IO daemon, store, device mode."""
    device = settings.get("device", {})
    return (
        f"pool {settings.get('pool_mode')}, IO {settings.get('io_label')}, "
        f"store {settings.get('store_label')}, device {device.get('device_mode', '-')}"
    )


def _store_line(store: dict[str, Any]) -> str:
    """GETs by transport and moves by destination, in one line."""
    gets = store.get("gets", {})
    moved_to = sorted(store.get("moved_to", {}).items())
    moved = ", ".join(f"{k} {v['count']} ({_mib(v['bytes'])})" for k, v in moved_to)
    return (
        f"GETs same/peer/host {gets.get('same-gpu', 0)}/{gets.get('peer-copy', 0)}/"
        f"{gets.get('host-to-device', 0)}; moved to {moved or 'nowhere'}"
    )


def print_report(report: BurstReport, file: Any = None) -> None:
    from rich.console import Console

    console = Console(file=file or sys.stdout, width=120)
    title = (
        f"burst: {report.workflow} ({report.system}, via {report.via}): "
        f"{len(report.outcomes)} requests, concurrency {report.concurrency}"
    )
    console.print(title, style="bold", highlight=False)
    _print_summary(console, report)
    _print_functions(console, report)
    _print_phases(console, report)
    for message, count in report.errors().items():
        console.print(f"[red]{count} x[/red] {message}", markup=True, highlight=False)


def _summary_rows(report: BurstReport) -> list[tuple[str, str]]:
    """The summary table's (label, value) rows: latency, throughput, cold starts, memory, settings."""
    lat = report.latency_ms()
    rows = [
        ("requests ok / failed", f"{report.ok} / {report.failed}"),
        ("latency p50 / p90 / p99 (ms)", f"{_ms(lat['p50'])} / {_ms(lat['p90'])} / {_ms(lat['p99'])}"),
        ("latency mean / max (ms)", f"{_ms(lat['mean'])} / {_ms(lat['max'])}"),
        ("throughput", f"{len(report.outcomes) / report.wall_s:,.2f} req/s" if report.wall_s else "-"),
        ("deploy (proxy start)", f"{report.deploy_s:,.2f} s"),
        ("cold starts: proxies / instances", f"{report.proxy_starts} / {report.instance_starts}"),
        (
            "device memory used / total",
            f"{_mib(report.memory.device_used_bytes)} / {_mib(report.memory.device_total_bytes)}",
        ),
        ("device memory used, peak", _mib(report.peak_memory.device_used_bytes)),
        (
            "pool reserved / used",
            f"{_mib(report.memory.pool_reserved_bytes)} / {_mib(report.memory.pool_used_bytes)}",
        ),
        ("pool reserved, peak", _mib(report.peak_memory.pool_reserved_bytes)),
        ("batched inferences / calls in them", f"{report.memory.batches} / {report.memory.batched_calls}"),
    ]
    if report.warmup:
        rows.insert(1, ("warm-up requests (not counted)", str(report.warmup)))
    if report.settings:
        rows.append(("mechanisms", _mechanisms(report.settings)))
    if report.store:
        rows.append(("store (GPU " + str(report.gpu) + ")", _store_line(report.store)))
    return rows


def _print_summary(console: Any, report: BurstReport) -> None:
    from rich.table import Table

    summary = Table(show_header=False)
    summary.add_column("", justify="left")
    summary.add_column("", justify="right")
    for row in _summary_rows(report):
        summary.add_row(*row)
    console.print(summary)


def _print_functions(console: Any, report: BurstReport) -> None:
    """Per function: calls, failures, cold starts, latency percentiles, queueing, instances."""
    from rich.table import Table

    functions = report.functions()
    if not functions:
        return
    table = Table(title="per function (latency as the invoker measured it)")
    for column in (
        "function",
        "calls",
        "failed",
        "cold starts",
        "p50 ms",
        "p90 ms",
        "max ms",
        "queued ms",
        "instances",
    ):
        table.add_column(column, justify="left" if column == "function" else "right")
    for function, row in functions.items():
        lat_f = row["latency_ms"]
        table.add_row(
            function,
            str(row["invocations"]),
            str(row["failed"]),
            str(row["cold_starts"]),
            _ms(lat_f["p50"]),
            _ms(lat_f["p90"]),
            _ms(lat_f["max"]),
            _ms(row["queued_ms_mean"]),
            str(report.peak_memory.instances.get(function, "-")),
        )
    console.print(table)


def _print_phases(console: Any, report: BurstReport) -> None:
    """Mean ms per phase along the critical path, and what "other" is made of."""
    from rich.table import Table

    phases = report.phases_ms()
    if not phases:
        return
    table = Table(title="where a request's time goes: mean ms per phase, along its critical path")
    for phase in phases:
        table.add_column(phase, justify="right")
    table.add_row(*(f"{ms:,.1f}" for ms in phases.values()))
    console.print(table)
    other = ", ".join(f"{part} {ms:,.1f}" for part, ms in report.other_ms().items())
    console.print(f"other, by where (mean ms): {other}", highlight=False)
    detail = ", ".join(f"{part} {ms:,.1f}" for part, ms in report.other_ms("detail_ms").items())
    if detail:
        console.print(f"of compute, the device once issued (mean ms): {detail}", highlight=False)


# -- command line (the parser: streambox.cli) ---------------------------------------------------
def cmd_burst(args: argparse.Namespace) -> int:
    from streambox.device.modes import describe_device_mode, device_mode_env

    config = config_from(args, device_mode="timed")
    inputs = inputs_from(args)
    if args.json is not None:  # before the run, not after it: a path that cannot be written lost it
        args.json.parent.mkdir(parents=True, exist_ok=True)
        if args.json.is_dir():
            raise IsADirectoryError(f"--json {args.json} is a folder; give a file path")
    print(describe_device_mode(config.device_mode, config.backend), flush=True)
    try:
        with device_mode_env(config.device_mode):  # the proxies it starts follow the run
            report = burst(
                args.path,
                requests=args.requests,
                concurrency=args.concurrency,
                warmup=args.warmup,
                input_path=args.input,
                params=args.params,
                inputs=inputs,
                via=args.via,
                system=args.system,
                config=config,
                proxy_options={
                    "model_shapes": inputs,
                    **proxy_options_from(args),
                },
            )
    except ProxyError as error:  # the proxy could not start: one line (its own log is above)
        print(f"streambox burst: error: the API proxy failed: {error}", file=sys.stderr)
        return 2
    print_report(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_json(), indent=1))
        print(f"wrote {args.json}")
    return 0 if report.failed == 0 else 1


__all__ = [
    "BurstReport",
    "Deployment",
    "Memory",
    "Outcome",
    "burst",
    "burst_async",
    "default_events",
    "parse_params",
    "prepare",
    "print_report",
    "resolve_params",
]
