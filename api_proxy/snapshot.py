"""The proxy's `stats` reply: counters, instances per function, device and pool memory, settings."""

from __future__ import annotations

import math
import os
import re
import resource
import threading
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from streambox.gc_pauses import PAUSES

from .partition import partitioning_of

if TYPE_CHECKING:
    from .proxy import ProxyServer


def snapshot(server: ProxyServer) -> dict[str, Any]:
    free, total = server.runtime.memory_info()
    pool = server.memory.pool
    res = server.resources
    s = server.stats
    return {
        "workflow": server.workflow,
        "functions": server.lifecycle.scheduler.summary(),
        "invocations": s.invocations,
        "failures": s.failures,
        "cold_starts": s.cold_starts,
        "instances_started": s.instances_started,
        "instances_stopped": s.instances_stopped,
        "instances_died": s.instances_died,
        "cancelled": s.cancelled,
        "idle_cpu_stops": s.idle_cpu_stops,
        "protocol_errors": s.protocol_errors,
        "calls": s.calls,
        "cold_start_s": s.cold_start_s[-256:],
        "device": {
            "index": server.config.device,
            "runtime_bytes": server.runtime.allocated_bytes(),
            "used_bytes": total - free,
            "total_bytes": total,
        },
        "pool": {
            "reserved_bytes": pool.reserved_bytes,
            "allocated_bytes": pool.allocated_bytes,
            "trims": pool.counters.trims,  # times the pool gave memory back to the device
            "counters": asdict(pool.counters),
        },
        "batching": res.batching.counters(),  # infers run as batches (api_proxy/batched_infer.py)
        "keys": len(server.store.keys()),
        # The data path: which store, the GPUs it sees, bytes per location (`gpu<i>`, `host`), counters.
        "store": {"kind": server.config.resolved_comm_store, **server.store.snapshot()},
        "buffers": len(res.buffers),
        # Streams of dropped instances not destroyed yet, and streams the pool holds frees for.
        "retiring_streams": server.lifecycle.retiring,
        "pool_tracked_streams": len(pool.tracked_streams()),
        "buffer_bytes": res.buffers.nbytes,
        "partitioning": {  # GPU% per function: the cap its kernels run under, and who holds them to it
            "mode": partitioning_of(server.runtime.properties().backend),
            "functions": {
                f.name: {"gpu_percent": f.gpu_percent, "cu_cap": res.cu_cap(f)}
                for f in server.config.functions
                if f.gpu_percent is not None
            },
        },
        "profiles": server.memory.profile_stats(),  # Algorithm 1's inputs: which functions had them
        "models_resident_bytes": server.memory.models.resident_bytes,
        "models": {"loads": server.memory.models.loads, "evictions": server.memory.models.evictions},
        "io": asdict(server.io.stats),
        "process": _process_usage(),  # the proxy's own host cost: all of its threads, since it started
        "settings": server.config.settings(),  # the mechanisms this run used, defaults resolved
        "timings": server.timings,
    }


def _process_usage() -> dict[str, Any]:
    """CPU seconds of this process (user, system) and its context switches since it started; per
    live thread role (thread names with their numbers as N: every `streambox-issuer_<i>` is
    `streambox-issuer_N`) its CPU seconds (`threads`) and the times it was scheduled in
    (`thread_runs`), read at most once per `THREAD_USAGE_MAX_AGE_S` (Linux only; empty elsewhere);
    its garbage-collector pauses (`streambox.gc_pauses`)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu, runs = _THREAD_USAGE.read()
    return {
        "cpu_user_s": usage.ru_utime,
        "cpu_system_s": usage.ru_stime,
        "voluntary_switches": float(usage.ru_nvcsw),
        "involuntary_switches": float(usage.ru_nivcsw),
        "threads": cpu,
        "thread_runs": runs,
        **PAUSES.counters(),
    }


#: Reading every thread's schedstat costs ~10 us per thread on the dispatcher (a proxy runs a few
#: dozen threads): at most once a second, whatever the stats rate.
THREAD_USAGE_MAX_AGE_S = 1.0


class _ThreadUsage:
    """Per thread role: CPU seconds and times scheduled in (`/proc/self/task/<tid>/schedstat`), cached."""

    def __init__(self) -> None:
        self._read_at = -math.inf
        self._value: tuple[dict[str, float], dict[str, float]] = ({}, {})

    def read(self) -> tuple[dict[str, float], dict[str, float]]:
        now = time.monotonic()
        if now - self._read_at >= THREAD_USAGE_MAX_AGE_S:
            self._value, self._read_at = _per_thread_role(), now
        return self._value


def _per_thread_role() -> tuple[dict[str, float], dict[str, float]]:
    cpu: dict[str, float] = {}
    runs: dict[str, float] = {}
    for thread in threading.enumerate():
        try:
            fd = os.open(f"/proc/self/task/{thread.native_id}/schedstat", os.O_RDONLY)
            try:
                run_ns, _, timeslices = os.read(fd, 256).split()[:3]
            finally:
                os.close(fd)
        except (OSError, ValueError):  # not Linux, or the thread ended meanwhile
            continue
        role = re.sub(r"\d+", "N", thread.name)  # one role for every numbered thread of a kind
        cpu[role] = cpu.get(role, 0.0) + int(run_ns) / 1e9
        runs[role] = runs.get(role, 0.0) + float(timeslices)
    return cpu, runs


_THREAD_USAGE = _ThreadUsage()
