"""An instance's host memory bound: what it may allocate beyond its warm template's heap.

An instance is a fork of its workflow's template, so it starts holding the template's data (torch, the
handlers' modules: ~0.9 GB of address space, shared copy-on-write). `limit_host_memory` sets the
kernel's `RLIMIT_DATA` (the private writable memory a process maps: heap, anonymous mmaps; Linux >=
4.7) to that size plus the function's `host_memory_mb`, so a handler that leaks or allocates without
bound gets `MemoryError` (torch: "can't allocate memory") at the limit instead of taking the host's
memory from the proxy and the other functions. `out_of_host_memory` tells such a failure apart; the
instance reports it and ends, so the function's next request gets a fresh instance rather than one
whose leak is still held. Reporting needs memory too (the traceback's text, the reply), which a leak
held to the brim leaves none of: `allow_report` lifts the limit by `REPORT_HEADROOM` first, as the
instance ends after the report anyway.
"""

from __future__ import annotations

import resource

from .errors import ProxyError

_KIB = 1024
#: What an instance out of host memory may allocate more to report it (a traceback, the reply).
REPORT_HEADROOM = 32 << 20


def data_bytes() -> int:
    """This process's data size as the kernel counts it for `RLIMIT_DATA` (`VmData`)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * _KIB
    raise OSError("no VmData in /proc/self/status")


def limit_host_memory(extra_bytes: int) -> int:
    """Let this process allocate at most `extra_bytes` more private memory than it holds now (within
    the hard limit); returns the limit set, in bytes."""
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = data_bytes() + extra_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    return limit


def out_of_host_memory(error: BaseException) -> bool:
    """Whether `error` is an allocation the limit refused (Python's, or torch's CPU allocator's); not a
    refusal the proxy sent back (`QuotaExceeded` is a `MemoryError` too, of the device or the store,
    and leaves the instance's host memory as it was)."""
    if isinstance(error, MemoryError):
        return not isinstance(error, ProxyError)
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


def allow_report(headroom_bytes: int = REPORT_HEADROOM) -> None:
    """Lift this process's data limit by `headroom_bytes` (within the hard limit), for an instance that
    ran out of host memory to report it before it ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if soft == resource.RLIM_INFINITY:
        return
    lifted = soft + headroom_bytes
    if hard != resource.RLIM_INFINITY:
        lifted = min(lifted, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (lifted, hard))
