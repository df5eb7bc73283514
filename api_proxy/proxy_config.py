"""What one workflow's proxy serves and how: plain records, JSON round-trip, torch-free.

`ProxyConfig.system`: `streambox` (memory pool `fm+rs`, IO daemon on) or `stream-only` (runtime
sharing only: static caching pool, FIFO copies) -- the CLI's `--system`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from .channel import CHANNELS
from .keepalive import DEFAULT_KEEP_ALIVE_S

COMPLETIONS = ("poll", "sync")
SYSTEMS = ("streambox", "stream-only")
MODEL_SHAPES = ("small", "full")


@dataclass(frozen=True)
class FunctionSpec:
    """One function of a workflow: its handler (`module:function`) and the models it may run."""

    name: str
    handler: str
    models: tuple[str, ...] = ()
    batch: int = 1
    max_instances: int = 4
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", tuple(self.models))
        if ":" not in self.handler:
            raise ValueError(f"function {self.name!r}: handler {self.handler!r} is not 'module:function'")
        if self.batch < 1 or self.max_instances < 1 or self.timeout_s <= 0:
            raise ValueError(f"function {self.name!r}: batch, max_instances and timeout_s must be positive")


@dataclass(frozen=True)
class ProxyConfig:
    """One proxy: a workflow's functions, the device, the channel, completion and keep-alive."""

    workflow: str
    functions: tuple[FunctionSpec, ...]
    device: int = 0
    system: str = "streambox"
    channel: str = field(default_factory=lambda: os.environ.get("STREAMBOX_CHANNEL", "shm"))
    completion: str = field(default_factory=lambda: os.environ.get("STREAMBOX_COMPLETION", "poll"))
    keep_alive_s: float = DEFAULT_KEEP_ALIVE_S  # idle instances stop after this (scale to zero)
    spin_us: float = 200.0  # how long a waiting side spins before it sleeps on its doorbell
    poll_us: float = 200.0  # `poll` completion: the pause between two queries of pending events
    ring_bytes: int = 1 << 20
    model_shapes: str = field(default_factory=lambda: os.environ.get("STREAMBOX_MODEL_SHAPES", "small"))
    preload: tuple[str, ...] = ("torch",)  # modules the template imports before any handler
    sys_path: tuple[str, ...] = ()  # prepended in the template (where the handler modules live)
    huge_pages: bool = True  # back the template's heap with huge pages (cheaper forks)
    prefork: int = 2  # spare instances the template keeps forked ahead (0: fork on demand)
    start_timeout_s: float = 30.0  # an instance must register within this
    # Device options (None: from the environment, see `streambox.config.Config.from_env`).
    backend: str | None = None
    device_preset: str | None = None
    gpus: int | None = None
    state_dir: str | None = None
    model_pool: str | None = None
    directory: str | None = None  # the proxy's owner-only directory (made by the launcher)

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "functions",
            tuple(f if isinstance(f, FunctionSpec) else FunctionSpec(**f) for f in self.functions),
        )
        object.__setattr__(self, "preload", tuple(self.preload))
        object.__setattr__(self, "sys_path", tuple(self.sys_path))
        for name, value, allowed in (
            ("channel", self.channel, CHANNELS),
            ("completion", self.completion, COMPLETIONS),
            ("system", self.system, SYSTEMS),
            ("model_shapes", self.model_shapes, MODEL_SHAPES),
        ):
            if value not in allowed:
                raise ValueError(f"{name} {value!r} is not one of {', '.join(allowed)}")
        if not self.workflow or "/" in self.workflow:
            raise ValueError(f"workflow name {self.workflow!r} must be non-empty and contain no '/'")
        names = [f.name for f in self.functions]
        if len(set(names)) != len(names):
            raise ValueError(f"workflow {self.workflow!r}: duplicate function names in {names}")
        if self.keep_alive_s < 0:
            raise ValueError(f"keep_alive_s must be >= 0, got {self.keep_alive_s}")

    def function(self, name: str) -> FunctionSpec:
        for f in self.functions:
            if f.name == name:
                return f
        known = ", ".join(f.name for f in self.functions)
        raise KeyError(f"workflow {self.workflow!r} has no function {name!r}; its functions: {known}")

    def with_overrides(self, **changes: Any) -> ProxyConfig:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ProxyConfig:
        data = json.loads(text)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown proxy config fields: {unknown}")
        return cls(**data)
