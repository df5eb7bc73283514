"""What one workflow's proxy serves and how: plain records, JSON round-trip, torch-free.

`ProxyConfig.system`: `streambox` (memory pool `fm+rs`, IO daemon on) or `stream-only` (runtime
sharing only: static caching pool, FIFO copies) -- the CLI's `--system`.

Per-run ablation switches override one mechanism each (None: the system's default; `settings()`
gives the resolved values, which the proxy reports in its `stats` reply):

- `pool_mode`: `static` | `fm` | `fm+rs` (`memory_pool.modes.PoolMode`);
- `io_daemon`: True (the IO daemon) | False (stream-only: FIFO copies straight to the copy engine);
- `io_block_bytes` (RZ: 2 MiB; 16 KiB is "RZ off"), `io_batch_blocks` (BT: 6 blocks per batch,
  two batches in flight; 1 = one block per call, each waited for), `io_shared_pinned` (PB: one
  shared pinned ring; off = a pinned buffer per request) -- the daemon's `DaemonConfig`;
- `recycler`: `kernel` | `thread` (where eager recycling runs);
- `weights_keep_alive_s`: how long shared model weights stay after their last user (default: the
  instances' `keep_alive_s`).

`ablation_options({"pool_mode": "fm", "io_daemon": "off", ...})` parses string values (the replay
harness's `--set KEY=VALUE`) into these fields.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from streambox.memory_pool.modes import PoolMode

from .channel import CHANNELS
from .keepalive import DEFAULT_KEEP_ALIVE_S

if TYPE_CHECKING:
    from streambox.io_daemon.config import DaemonConfig

COMPLETIONS = ("poll", "sync")
SYSTEMS = ("streambox", "stream-only")
MODEL_SHAPES = ("small", "full")
POOL_MODES = tuple(m.value for m in PoolMode)
RECYCLERS = ("kernel", "thread")  # as `executor.RECYCLERS` (which imports torch)
#: The IO daemon's fields: set only while the daemon is on.
IO_FIELDS = ("io_block_bytes", "io_batch_blocks", "io_shared_pinned")


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
    # Ablation switches (None: the system's default; see the module doc and `settings()`).
    pool_mode: str | None = None  # static | fm | fm+rs
    io_daemon: bool | None = None  # False: FIFO copies straight to the copy engine
    io_block_bytes: int | None = None  # RZ (2 MiB)
    io_batch_blocks: int | None = None  # BT (6; 1 = one block per call)
    io_shared_pinned: bool | None = None  # PB (on)
    recycler: str | None = None  # kernel | thread
    weights_keep_alive_s: float | None = None  # shared weights (default: keep_alive_s)

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
        self._check_ablation()

    def _check_ablation(self) -> None:
        if self.pool_mode is not None:
            try:
                mode = PoolMode.parse(str(self.pool_mode))
            except ValueError:
                raise ValueError(
                    f"pool_mode {self.pool_mode!r} is not one of {', '.join(POOL_MODES)}"
                ) from None
            object.__setattr__(self, "pool_mode", mode.value)
        if self.recycler is not None and self.recycler not in RECYCLERS:
            raise ValueError(f"recycler {self.recycler!r} is not one of {', '.join(RECYCLERS)}")
        for name in ("io_daemon", "io_shared_pinned"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be on or off (true or false), got {value!r}")
        for name in ("io_block_bytes", "io_batch_blocks"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        keep = self.weights_keep_alive_s
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int | float) or keep < 0):
            raise ValueError(f"weights_keep_alive_s must be a number >= 0, got {keep!r}")
        if not self.io_daemon_on:
            given = [name for name in IO_FIELDS if getattr(self, name) is not None]
            if given:
                raise ValueError(
                    f"{', '.join(given)}: options of the IO daemon, which is off here (system "
                    f"{self.system!r}, io_daemon {self.io_daemon}); set io_daemon on or drop them"
                )

    # -- the resolved mechanisms -----------------------------------------------------------------
    @property
    def resolved_pool_mode(self) -> PoolMode:
        if self.pool_mode is not None:
            return PoolMode(self.pool_mode)
        return PoolMode.FM_RS if self.system == "streambox" else PoolMode.STATIC

    @property
    def io_daemon_on(self) -> bool:
        return self.io_daemon if self.io_daemon is not None else self.system == "streambox"

    @property
    def resolved_recycler(self) -> str:
        return self.recycler or "kernel"

    @property
    def resolved_weights_keep_alive_s(self) -> float:
        return float(
            self.weights_keep_alive_s if self.weights_keep_alive_s is not None else self.keep_alive_s
        )

    def daemon_config(self) -> DaemonConfig:
        """The IO daemon's configuration: `stream_only()` when off, else the defaults with the
        RZ/BT/PB fields given here (BT off, one block per batch, also keeps one batch in flight)."""
        from streambox.io_daemon.config import DaemonConfig  # torch: imported only where it runs

        if not self.io_daemon_on:
            return DaemonConfig.stream_only()
        default = DaemonConfig()
        batch = self.io_batch_blocks if self.io_batch_blocks is not None else default.batch_blocks
        return DaemonConfig(
            block_size=self.io_block_bytes if self.io_block_bytes is not None else default.block_size,
            batch_blocks=batch,
            inflight_batches=1 if batch == 1 else default.inflight_batches,
            pinned_buffer=self.io_shared_pinned
            if self.io_shared_pinned is not None
            else default.pinned_buffer,
        )

    def settings(self) -> dict[str, Any]:
        """Every mechanism as this proxy runs it (defaults resolved), for a run's records."""
        daemon = self.daemon_config()
        on = daemon.mode == "streambox"
        return {
            "system": self.system,
            "pool_mode": self.resolved_pool_mode.value,
            "recycler": self.resolved_recycler,
            "keep_alive_s": float(self.keep_alive_s),
            "weights_keep_alive_s": self.resolved_weights_keep_alive_s,
            "io_daemon": on,
            "io_block_bytes": daemon.block_size if on else None,
            "io_batch_blocks": daemon.batch_blocks if on else None,
            "io_inflight_batches": daemon.inflight_batches if on else None,
            "io_shared_pinned": daemon.pinned_buffer if on else None,
            "io_label": daemon.label,
        }

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


# ================================================================================= string options
_TRUE, _FALSE = ("on", "true", "yes", "1"), ("off", "false", "no", "0")
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}  # fmt: skip


def parse_switch(text: str, what: str = "value") -> bool:
    """`on`/`off` (also true/false, yes/no, 1/0; any case) as a bool."""
    value = str(text).strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ValueError(f"{what} {text!r} is not on or off (true/false, yes/no, 1/0)")


def parse_bytes(text: str, what: str = "value") -> int:
    """A byte count: `2097152`, `2MiB`, `2M`, `16KiB`, `16k` (binary units, any case)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"{what} {text!r} is not a byte count (e.g. 2097152, 2MiB, 16KiB)")
    return int(float(match.group(1)) * _UNITS[unit])


def _integer(text: str, what: str) -> int:
    try:
        return int(str(text).strip())
    except ValueError:
        raise ValueError(f"{what} {text!r} is not an integer") from None


def _seconds(text: str, what: str) -> float:
    try:
        return float(str(text).strip().removesuffix("s"))
    except ValueError:
        raise ValueError(f"{what} {text!r} is not a number of seconds") from None


def _choice(allowed: tuple[str, ...]) -> Callable[[str, str], str]:
    def parse(text: str, what: str) -> str:
        value = str(text).strip().lower()
        if value not in allowed:
            raise ValueError(f"{what} {text!r} is not one of {', '.join(allowed)}")
        return value

    return parse


#: The string options `ablation_options` takes: field -> parser(text, what).
ABLATION_PARSERS: dict[str, Callable[[str, str], Any]] = {
    "pool_mode": _choice(POOL_MODES),
    "io_daemon": parse_switch,
    "io_block_bytes": parse_bytes,
    "io_batch_blocks": _integer,
    "io_shared_pinned": parse_switch,
    "recycler": _choice(RECYCLERS),
    "weights_keep_alive_s": _seconds,
}


def ablation_options(strings: Mapping[str, str]) -> dict[str, Any]:
    """`ProxyConfig` fields from string options (`{"pool_mode": "fm", "io-daemon": "off"}`): keys
    ignore case and take `-` for `_`; values are parsed and checked here, so a mistake names its
    key (an unknown key lists the known ones). Pass the result as `ProxyInvoker(proxy_options=...)`
    or `ProxyConfig(..., **options)`."""
    options: dict[str, Any] = {}
    for key, text in strings.items():
        name = str(key).strip().lower().replace("-", "_")
        parser = ABLATION_PARSERS.get(name)
        if parser is None:
            raise ValueError(f"unknown proxy option {key!r}; known options: {', '.join(ABLATION_PARSERS)}")
        options[name] = parser(text, name)
    return options
