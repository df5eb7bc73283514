"""The gateway's Prometheus metrics (prometheus_client, one private registry per gateway).

Request side, updated once per request from its `RequestResult`:

- ``streambox_requests_total{workflow,status}``: status ok | error | timeout;
- ``streambox_request_latency_seconds{workflow}``: histogram of end-to-end latency;
- ``streambox_slo_violations_total{workflow}``: requests that failed or ran past the SLO;
- ``streambox_requests_in_flight{workflow}``: admitted (their bodies being read or parsed, or running);
- ``streambox_requests_refused_total{workflow}``: answered 503 at the gateway's admission limits;
- ``streambox_function_invocations_total{workflow,function,status}``;
- ``streambox_function_latency_seconds{workflow,function}``: histogram, as the invoker measured it;
- ``streambox_cold_starts_total{workflow,function}``.

Runtime side, read at each scrape from the stats callback (`invoker.StatsSource`):

- ``streambox_device_memory_used_bytes{device}``, ``streambox_device_memory_total_bytes{device}``;
- ``streambox_pool_reserved_bytes{workflow,device}``, ``streambox_pool_used_bytes{workflow,device}``;
- ``streambox_function_instances{workflow,function}``;
- ``streambox_unprofiled_runs{workflow}``: model runs the pool's scaler saw without an offline profile;
- ``streambox_batches_total{workflow}``, ``streambox_batched_calls_total{workflow}``: batched inferences
  run (more than one invocation each) and the calls they served (docs/workflows.md, "Batching");
- ``streambox_runtime_stats_up``: 0 when the callback failed (the other metrics are still served).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .engine import RequestResult
from .invoker import StatsSource

log = logging.getLogger(__name__)

#: Seconds: from a warm small model (milliseconds) to cold loads of large ones on the emulated GPU.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _RuntimeCollector(Collector):
    def __init__(self, stats: StatsSource) -> None:
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []  # do not call the proxy at registration

    def collect(self) -> Iterator[Metric]:
        used = GaugeMetricFamily(
            "streambox_device_memory_used_bytes", "Device memory in use (all runtimes)", labels=["device"]
        )
        total = GaugeMetricFamily("streambox_device_memory_total_bytes", "Device memory", labels=["device"])
        reserved = GaugeMetricFamily(
            "streambox_pool_reserved_bytes",
            "Bytes a workflow's memory pool holds",
            labels=["workflow", "device"],
        )
        pool_used = GaugeMetricFamily(
            "streambox_pool_used_bytes", "Bytes of the pool handed out", labels=["workflow", "device"]
        )
        instances = GaugeMetricFamily(
            "streambox_function_instances", "Live function instances", labels=["workflow", "function"]
        )
        unprofiled = GaugeMetricFamily(
            "streambox_unprofiled_runs", "Model runs without an offline profile (fm+rs)", labels=["workflow"]
        )
        batches = CounterMetricFamily(
            "streambox_batches", "Batched inferences run (more than one invocation each)", labels=["workflow"]
        )
        batched_calls = CounterMetricFamily(
            "streambox_batched_calls", "Invocations' calls served by batched inferences", labels=["workflow"]
        )
        up = GaugeMetricFamily("streambox_runtime_stats_up", "1 if the runtime stats were read")
        try:
            rows = list(self._stats())
        except Exception:
            log.exception("runtime stats callback failed")
            up.add_metric([], 0)
            yield up
            return
        devices: dict[str, tuple[int, int]] = {}
        batching: dict[str, tuple[int, int]] = {}
        for row in rows:
            device = str(row.device)
            devices[device] = (row.memory_used_bytes, row.memory_total_bytes)
            reserved.add_metric([row.workflow, device], row.pool_reserved_bytes)
            pool_used.add_metric([row.workflow, device], row.pool_used_bytes)
            for function, count in row.instances.items():
                instances.add_metric([row.workflow, function], count)
            unprofiled.add_metric([row.workflow], row.unprofiled_runs)
            counted = batching.get(row.workflow, (0, 0))  # per workflow: a row per device repeats them
            batching[row.workflow] = (max(counted[0], row.batches), max(counted[1], row.batched_calls))
        for workflow, (runs, calls) in batching.items():
            batches.add_metric([workflow], runs)
            batched_calls.add_metric([workflow], calls)
        for device, (u, t) in devices.items():
            used.add_metric([device], u)
            total.add_metric([device], t)
        up.add_metric([], 1)
        yield from (used, total, reserved, pool_used, instances, unprofiled, batches, batched_calls, up)


class GatewayMetrics:
    def __init__(self, stats: StatsSource | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "streambox_requests", "Workflow requests by final status", ["workflow", "status"], registry=r
        )
        self.latency = Histogram(
            "streambox_request_latency_seconds",
            "End-to-end request latency",
            ["workflow"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.slo_violations = Counter(
            "streambox_slo_violations", "Requests that failed or missed the SLO", ["workflow"], registry=r
        )
        self.in_flight = Gauge(
            "streambox_requests_in_flight", "Requests admitted (reading, parsing or running)", ["workflow"],
            registry=r,
        )
        self.refused = Counter(
            "streambox_requests_refused",
            "Invocations answered 503 at the gateway's admission limits",
            ["workflow"],
            registry=r,
        )
        self.invocations = Counter(
            "streambox_function_invocations",
            "Function invocations by status",
            ["workflow", "function", "status"],
            registry=r,
        )
        self.function_latency = Histogram(
            "streambox_function_latency_seconds",
            "Function invocation latency (cold start included)",
            ["workflow", "function"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.cold_starts = Counter(
            "streambox_cold_starts",
            "Invocations that started a new function instance",
            ["workflow", "function"],
            registry=r,
        )
        if stats is not None:
            r.register(_RuntimeCollector(stats))

    def observe(self, result: RequestResult) -> None:
        wf = result.workflow
        self.requests.labels(wf, result.status).inc()
        self.latency.labels(wf).observe(result.latency_s)
        if not result.slo_met:
            self.slo_violations.labels(wf).inc()
        for call in result.calls:
            self.invocations.labels(wf, call.function, call.status).inc()
            if call.latency_s is not None:
                self.function_latency.labels(wf, call.function).observe(call.latency_s)
            if call.cold_start:
                self.cold_starts.labels(wf, call.function).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
