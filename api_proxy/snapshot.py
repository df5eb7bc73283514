"""The proxy's `stats` reply: counters, instances per function, device and pool memory, settings."""

from __future__ import annotations

import os
import re
import resource
import threading
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

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
    live thread role (thread names without their numbering, e.g. every `streambox-issuer_<i>` as one)
    its CPU seconds (`threads`) and voluntary switches, i.e. times it blocked (`thread_switches`).
    The per-thread figures are Linux only (empty elsewhere)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu, switches = _per_thread_role()
    return {
        "cpu_user_s": usage.ru_utime,
        "cpu_system_s": usage.ru_stime,
        "voluntary_switches": float(usage.ru_nvcsw),
        "involuntary_switches": float(usage.ru_nivcsw),
        "threads": cpu,
        "thread_switches": switches,
    }


def _per_thread_role() -> tuple[dict[str, float], dict[str, float]]:
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    cpu: dict[str, float] = {}
    switches: dict[str, float] = {}
    for thread in threading.enumerate():
        task = f"/proc/self/task/{thread.native_id}"
        try:
            with open(f"{task}/stat") as stream:
                fields = stream.read().rsplit(")", 1)[1].split()
            with open(f"{task}/status") as stream:
                status = stream.read()
        except (OSError, IndexError):  # not Linux, or the thread ended meanwhile
            continue
        role = re.sub(r"[-_]?\d+(?= \(|$)", "", thread.name) or thread.name
        cpu[role] = cpu.get(role, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
        found = re.search(r"^voluntary_ctxt_switches:\s*(\d+)", status, re.MULTILINE)
        switches[role] = switches.get(role, 0.0) + (float(found.group(1)) if found else 0.0)
    return cpu, switches
