"""What the replay drives: the `Target` protocol, its `Outcome`, and the registry of systems.

A system under test (streambox, stream-only, monolithic) is reached through a `Target`: the driver
calls `send` once per arrival without waiting for earlier ones, and `sample` every sampling period.
`resolve_system(name, request)` turns a `--system` name into a Target through the registry; systems
register with `register_system(name, factory)`, where the factory is a callable or a lazy
"module:attribute" string (so that registering costs no import of torch or of a device backend).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

#: `Outcome.status` values. Anything but "ok" counts as an SLO violation.
STATUSES = ("ok", "error", "timeout", "rejected", "cancelled")

#: Keys of `Target.sample()` that the report knows (all bytes; any other numeric key is kept in
#: samples.csv as is). Memory by component: "memory.<component>_bytes", e.g. "memory.weights_bytes".
SAMPLE_KEYS = {
    "memory_used_bytes": "device memory used by the system, all components (what nvidia-smi shows)",
    "pool_bytes": "memory held by the memory pool(s), used and cached",
    "demand_bytes": "live demand: bytes the running functions need right now",
}
COMPONENT_PREFIX = "memory."
#: A sample key with this prefix is a running count since the system started (the pool's grows, the IO
#: daemon's blocks); the summary reports its last value (`summarize`, "counters").
COUNTER_PREFIX = "counter."
#: `workflow_memory.<workflow>`: device bytes of one workflow's runtimes (its proxy, or its instances:
#: contexts, framework runtimes and everything they allocated); the summary's `memory_by_workflow`.
WORKFLOW_MEMORY_PREFIX = "workflow_memory."

#: The systems the replay compares (registered below; see replay/systems.py).
PLANNED_SYSTEMS = ("streambox", "stream-only", "infless", "astraea", "monolithic")


@dataclass(frozen=True)
class Outcome:
    """What one request came to. `latency_s` is the target's own measure of the request (the driver
    also measures it from outside); `cold_start` is true when it had to start a function instance."""

    latency_s: float
    status: str = "ok"
    cold_start: bool = False
    error: str | None = None
    #: seconds by phase (`streambox.phases.PHASES`: cold_start, queue, model_load, compute, comm,
    #: other), adding up to `latency_s`; empty when the target cannot measure them
    phases: Mapping[str, float] = field(default_factory=dict)


@runtime_checkable
class Target(Protocol):
    """A system under test, as the driver sees it.

    `send` must not block the event loop (run blocking work in a thread or another process); the
    driver calls it for every arrival at its time, however many are outstanding. `sample` is called
    from a worker thread every sampling period; it must only read, and return numbers (see
    SAMPLE_KEYS). `start` runs before the first arrival and is not timed; `close` after the last.
    `describe` returns the system's own configuration (ablation flags, presets) for config.json.
    A target whose samples read figures it refreshes periodically may also define `async refresh()`:
    the driver awaits it once the last request is done, before the final sample (so that running
    counts, `COUNTER_PREFIX`, cover the whole run)."""

    name: str

    async def start(self) -> None: ...

    async def send(self, workflow: str, event: dict[str, Any]) -> Outcome: ...

    def sample(self) -> dict[str, float]: ...

    def describe(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class FunctionProfile:
    """What the trace says about one replayed function, for a target that wants to size instances."""

    key: str  # "app/function"
    workflow: str
    pattern: str
    trigger: str | None
    duration_p50_ms: float | None
    memory_mb: float | None


@dataclass(frozen=True)
class SystemRequest:
    """Everything a factory gets to build a Target for one run."""

    system: str
    workflows: tuple[str, ...]
    functions: tuple[FunctionProfile, ...] = ()
    options: Mapping[str, str] = field(default_factory=dict)  # --set KEY=VALUE (ablation flags, ...)
    seed: int = 0
    slo_s: float = 0.2
    time_scale: float = 1.0  # replay seconds per trace second (--minute-seconds / 60)


SystemFactory = Callable[[SystemRequest], Target]


class UnknownSystem(ValueError):
    """A --system name that the registry does not know; the message lists the known ones."""


_REGISTRY: dict[str, SystemFactory | str] = {}
_DESCRIPTIONS: dict[str, str] = {}


def register_system(name: str, factory: SystemFactory | str, description: str = "") -> None:
    """Register a system. `factory` is a callable taking a SystemRequest, or "module:attribute" naming
    one, imported at the first `resolve_system`. Registering a name again replaces it."""
    if isinstance(factory, str) and ":" not in factory:
        raise ValueError(f"lazy factory {factory!r} must read 'module:attribute'")
    _REGISTRY[name] = factory
    _DESCRIPTIONS[name] = description


def known_systems() -> dict[str, str]:
    """Registered system names and their one-line descriptions."""
    return {name: _DESCRIPTIONS.get(name, "") for name in sorted(_REGISTRY)}


def _load(spec: SystemFactory | str) -> SystemFactory:
    if not isinstance(spec, str):
        return spec
    module, _, attribute = spec.partition(":")
    return getattr(importlib.import_module(module), attribute)


def resolve_system(name: str, request: SystemRequest | None = None) -> Target:
    """Build the Target for `name`, or raise UnknownSystem listing the known systems."""
    if name not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY)) or "(none)"
        hint = f" ('{name}' is planned but not wired to a target yet)" if name in PLANNED_SYSTEMS else ""
        raise UnknownSystem(f"unknown system {name!r}{hint}; known systems: {known}")
    request = request or SystemRequest(system=name, workflows=())
    return _load(_REGISTRY[name])(request)


register_system(
    "inprocess-cpu",
    "streambox.replay.inprocess:make_inprocess_target",
    "reference target in this process: numpy 'models' on a CPU thread pool with keep-alive "
    "(for checking the harness; not one of the systems under test)",
)
register_system(
    "streambox",
    "streambox.replay.systems:make_streambox_target",
    "StreamBox: one API proxy per workflow, a stream per function instance, memory pool fm+rs, "
    "IO daemon, communication store in GPU memory",
)
register_system(
    "stream-only",
    "streambox.replay.systems:make_stream_only_target",
    "the proxy with StreamBox's mechanisms off: runtime sharing through streams only "
    "(static caching pool, FIFO copies)",
)
register_system(
    "infless",
    "streambox.replay.systems:make_infless_target",
    "INFless (Table 2): one process and one runtime per function instance with an MPS share (GPU%), "
    "its own model copy, pre-warmed, keep-alive, data between functions through Redis (Func-IPC)",
)
register_system(
    "astraea",
    "streambox.replay.systems:make_astraea_target",
    "Astraea (Table 2): infless's instances (a process, a runtime and an MPS share each, pre-warmed), "
    "data by CUDA-IPC handle, intermediate data cached in the producer's GPU memory (open/close modelled)",
)
register_system(
    "monolithic",
    "streambox.replay.systems:make_monolithic_target",
    "deprecated name of infless (kept for one release)",
)
