"""The settings tree: one set of pydantic models from which the environment, the command lines of
`serve`, `burst` and `replay`, the proxies' records (`stats`) and a replay's config.json are built.

- `Config`: the device side (backend, preset, GPUs, execution mode, model pool, ledger directory).
- `Mechanisms`: the paper's mechanisms, each switchable per run (the ablations), and how a system
  (`streambox`, `stream-only`) resolves those left unset. `api_proxy.proxy_config.ProxyConfig`
  extends it; `daemon_config()` and `store_config()` build the library dataclasses that the IO
  daemon and the communication store take (`DaemonConfig`, `StoreConfig`), which stay plain so that
  their pure policies do not depend on pydantic.
- `Tuning`: the libraries' other knobs in groups (`pool`, `store`, `memory`), each checked against
  the library's own dataclass (`PoolConfig`, `StoreConfig`, `MemoryOptions`).
- `RunOptions`: what a run of the three commands shares besides: input sizes, completion, channel.
- `Settings`: the environment (`STREAMBOX_<FIELD>`, groups with the nested delimiter `__`:
  `STREAMBOX_POOL__CHUNK_BYTES`) over all of them.

One spelling everywhere: a field `pool_mode` is the flag `--pool-mode`, the replay option
`--set pool_mode=fm` (or `pool-mode`, any case) and the variable `STREAMBOX_POOL_MODE`. Switches take
on/off (also true/false, yes/no, 1/0). A bad value raises `SettingsError` naming the field, the value
and what is allowed. This module imports neither torch nor any device library (the `--help` path).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_core import to_jsonable_python
from pydantic_settings import BaseSettings, SettingsConfigDict

from streambox.settings_base import (
    ENV_PREFIX,
    SettingsError,
    SettingsModel,
    build,
    check_keys,
    env_factory,
    env_group,
    library_config,
    option_name,
    settings_error,
    words,
)

if TYPE_CHECKING:
    from streambox.comm.config import StoreConfig
    from streambox.device import Backend, DeviceSpec
    from streambox.io_daemon.config import DaemonConfig
    from streambox.memory_pool.modes import PoolMode

BACKENDS = ("emulated", "cuda")  # as streambox.device.BACKENDS (a test keeps them equal)
DEVICE_MODES = ("functional", "timed")
SYSTEMS = ("streambox", "stream-only")
POOL_MODES = ("static", "fm", "fm+rs")  # memory_pool.modes.PoolMode's values
RECYCLERS = ("kernel", "thread")  # as api_proxy.executor.RECYCLERS (which imports torch)
INPUTS = ("small", "full")
COMPLETIONS = ("poll", "sync")
CHANNELS = ("shm", "zmq")  # as api_proxy.channel.CHANNELS (which imports zmq)
COMM_STORES = ("managed", "ipc")  # as comm.store_protocol.STORE_KINDS (which imports torch)
#: The managed store's switches: meaningful only with it.
STORE_SWITCHES = ("pa", "am")
#: The IO daemon's switches: meaningful only while the daemon is on.
IO_SWITCHES = ("rz", "pb", "bt")


MODEL_POOL_ENV = "STREAMBOX_MODEL_POOL"  # kernel_compiler.model_pool.default_root reads it too


def default_model_pool() -> Path:
    """Where plans and registered models live: `$STREAMBOX_MODEL_POOL`, else a folder in the user's cache
    (every command and benchmark takes it from here, so that they all see the same pool)."""
    env = os.environ.get(MODEL_POOL_ENV)
    return Path(env) if env else Path.home() / ".cache" / "streambox" / "model_pool"


class DeviceFields(SettingsModel):
    backend: Literal["emulated", "cuda"] = Field("emulated", description="device backend")
    device_preset: str = Field(
        "v100-16gb", description="emulated device preset: v100-16gb, h100-80gb (streambox.device.PRESETS)"
    )
    gpus: int = Field(
        1,
        ge=1,
        le=64,  # each GPU is a ledger file and its runtimes' state: a typo of 10**8 opened files until EMFILE
        description="GPUs of the node: proxies are placed on the one with the least memory in use, and "
        "AM moves a proxy's data to the least-pressured other GPU before host",
    )
    # From $STREAMBOX_DEVICE_MODE even when a Config is built field by field, so that the processes a
    # run starts (proxies, monolithic instances) follow the run's mode.
    device_mode: Literal["functional", "timed"] = Field(
        default_factory=lambda: os.environ.get("STREAMBOX_DEVICE_MODE", "functional"),
        description="functional: kernels run as fast as the host can; timed: each occupies its stream "
        "and compute units for its modelled GPU time",
    )

    @field_validator("backend", "device_mode", "device_preset", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return words(value)


class Config(DeviceFields):
    """Which device backend and preset, in which mode, and where the model pool and ledger live."""

    model_pool: Path = Field(default_factory=default_model_pool, description="where kernel plans live")
    state_dir: Path | None = Field(None, description="the emulated devices' shared ledger")
    # Every runtime opened through this config also pays the ML framework's runtime (memory and
    # initialisation, DeviceSpec.framework_*): the runtime of a monolithic PyTorch function.
    framework_runtime: bool = Field(False, description="runtimes also pay the framework's cost")

    @field_validator("device_preset")
    @classmethod
    def _known_preset(cls, value: str) -> str:
        from streambox.device.specs import PRESETS  # the device package (torch): only where it runs

        if value not in PRESETS:
            raise ValueError(f"is not one of {', '.join(sorted(PRESETS))}")
        return value

    @classmethod
    def from_env(cls, **defaults: Any) -> Config:
        """The environment's configuration; `defaults` (a command's own, e.g. `device_mode="timed"`
        for replay and burst) apply where the environment sets nothing."""
        return Settings.from_env().config(**defaults)

    def with_overrides(self, **changes: Any) -> Config:
        """This configuration with the given fields replaced (None: keep); validated again."""
        given = {k: v for k, v in changes.items() if v is not None}
        return Config(**{**self.model_dump(), **given}) if given else self

    def validated(self) -> Config:
        return self  # validated on construction; kept for callers of the former dataclass

    def device_spec(self) -> DeviceSpec:
        from streambox.device import preset

        return preset(self.device_preset)

    def open_backend(self) -> Backend:
        from streambox.device import get_backend

        if self.backend == "emulated":
            options: dict[str, Any] = {
                "spec": self.device_spec(),
                "count": self.gpus,
                "mode": self.device_mode,
                "framework": self.framework_runtime,
            }
            if self.state_dir is not None:
                options["state_dir"] = self.state_dir
            return get_backend("emulated", **options)
        return get_backend(self.backend)

    def resolved(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# ======================================================================================== mechanisms
class Mechanisms(SettingsModel):
    """The paper's mechanisms, one switch each; None resolves to the `system`'s choice.

    FM and RS are one field, `pool_mode` (`static`: neither; `fm`: FM alone; `fm+rs`: both), since
    RS scales the pool to the demand that FM's lazy allocation and eager recycling create: RS
    without FM is not a configuration of the paper.
    """

    system: Literal["streambox", "stream-only"] = Field(
        "streambox", description="streambox (all mechanisms) or stream-only (runtime sharing alone)"
    )
    pool_mode: Literal["static", "fm", "fm+rs"] | None = Field(
        default_factory=env_factory("pool_mode"),
        description="memory pool: static | fm (FM) | fm+rs (FM and RS); default: the system's",
    )
    recycler: Literal["kernel", "thread"] | None = Field(
        default_factory=env_factory("recycler"),
        description="where eager recycling runs: kernel (default) | thread",
    )
    io_daemon: bool | None = Field(
        default_factory=env_factory("io_daemon"),
        description="the IO daemon, or FIFO copies straight to the copy engine",
    )
    rz: bool | None = Field(
        default_factory=env_factory("rz"),
        description="the IO daemon's right-sized 2 MiB blocks (RZ; off: 16 KiB)",
    )
    pb: bool | None = Field(
        default_factory=env_factory("pb"),
        description="one shared pinned buffer (PB; off: one per request)",
    )
    bt: bool | None = Field(
        default_factory=env_factory("bt"),
        description="batched transfer, 6 blocks a call, 2 batches in flight (BT)",
    )
    comm_store: Literal["managed", "ipc"] | None = Field(
        default_factory=env_factory("comm_store"),
        description="how functions pass data: managed (StreamBox's elastic store) | ipc (CUDA-IPC "
        "style, no managed store); default: the system's",
    )
    pa: bool | None = Field(
        default_factory=env_factory("pa"),
        description="the store sizes itself to predicted idle memory (PA)",
    )
    am: bool | None = Field(
        default_factory=env_factory("am"),
        description="data leaving a GPU goes to a neighbour GPU before host (AM)",
    )
    weights_keep_alive_s: float | None = Field(
        default_factory=env_factory("weights_keep_alive_s"),
        ge=0,
        allow_inf_nan=False,  # a proxy's config travels as JSON, which has no infinity
        description="seconds shared model weights stay after their last use (default: keep-alive)",
    )

    @field_validator(
        "system", "pool_mode", "recycler", "io_daemon", "comm_store", "rz", "pb", "bt", "pa", "am",
        mode="before",
    )
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return words(value)

    @model_validator(mode="after")
    def _io_switches_need_the_daemon(self) -> Mechanisms:
        given = [name for name in IO_SWITCHES if getattr(self, name) is not None]
        if given and not self.io_daemon_on:
            raise ValueError(
                f"{', '.join(given)}: switches of the IO daemon, which is off here (system "
                f"{self.system!r}, io_daemon {self.io_daemon}); set io_daemon on or drop them"
            )
        return self

    @model_validator(mode="after")
    def _store_switches_need_the_managed_store(self) -> Mechanisms:
        given = [name for name in STORE_SWITCHES if getattr(self, name) is not None]
        if given and self.resolved_comm_store != "managed":
            raise ValueError(
                f"{', '.join(given)}: switches of the managed store, which is not used here (system "
                f"{self.system!r}, comm_store {self.resolved_comm_store!r}); set comm_store managed or "
                f"drop them"
            )
        return self

    @model_validator(mode="after")
    def _recycler_needs_eager_recycling(self) -> Mechanisms:
        if self.recycler is not None and not self.resolved_pool_mode.eager_recycling:
            raise ValueError(
                f"recycler {self.recycler!r}: where eager recycling runs, which pool_mode "
                f"{self.resolved_pool_mode.value!r} does not do (system {self.system!r}); set pool_mode "
                f"fm or fm+rs or drop it"
            )
        return self

    # -- resolved -----------------------------------------------------------------------------
    @property
    def resolved_pool_mode(self) -> PoolMode:
        from streambox.memory_pool.modes import PoolMode

        if self.pool_mode is not None:
            return PoolMode(self.pool_mode)
        return PoolMode.FM_RS if self.system == "streambox" else PoolMode.STATIC

    @property
    def resolved_comm_store(self) -> str:
        """`managed` (StreamBox's CommStore) or `ipc` (stream-only's IpcStore)."""
        if self.comm_store is not None:
            return self.comm_store
        return "managed" if self.system == "streambox" else "ipc"

    @property
    def io_daemon_on(self) -> bool:
        return self.io_daemon if self.io_daemon is not None else self.system == "streambox"

    @property
    def resolved_recycler(self) -> str:
        return self.recycler or "kernel"

    def daemon_config(self) -> DaemonConfig:
        """The IO daemon's configuration: `stream_only()` when off, else RZ/PB/BT as switched (on
        unless switched off)."""
        from streambox.io_daemon.config import DaemonConfig

        if not self.io_daemon_on:
            return DaemonConfig.stream_only()
        return DaemonConfig.ablation(
            rz=self.rz is not False, pb=self.pb is not False, bt=self.bt is not False
        )

    def store_config(self, base: StoreConfig | None = None) -> StoreConfig:
        """The communication store's configuration (`base`, default the library's) with PA and AM as
        switched (on unless off; both systems' store is StreamBox's today)."""
        from streambox.comm.config import StoreConfig

        return (base or StoreConfig()).ablation(pa=self.pa is not False, am=self.am is not False)

    def resolved(self) -> dict[str, Any]:
        """Every mechanism as it runs (defaults resolved), for `stats` and config.json."""
        daemon = self.daemon_config()
        on = daemon.mode == "streambox"
        store = self.store_config()
        managed = self.resolved_comm_store == "managed"
        return {
            "system": self.system,
            "pool_mode": self.resolved_pool_mode.value,
            "recycler": self.resolved_recycler,
            "io_daemon": on,
            "rz": daemon.block_size >= (2 << 20) if on else None,
            "pb": daemon.pinned_buffer if on else None,
            "bt": daemon.batch_blocks > 1 if on else None,
            "io_block_bytes": daemon.block_size if on else None,
            "io_batch_blocks": daemon.batch_blocks if on else None,
            "io_inflight_batches": daemon.inflight_batches if on else None,
            "io_shared_pinned": daemon.pinned_buffer if on else None,
            "io_label": daemon.label,
            "comm_store": self.resolved_comm_store,
            "pa": store.pressure_aware if managed else None,
            "am": store.adaptive_movement if managed else None,
            "store_label": store.label if managed else "CUDA-IPC style (no managed store)",
        }


#: The ablation switches every command takes (`system` is each command's own `--system`).
MECHANISM_FIELDS = tuple(name for name in Mechanisms.model_fields if name != "system")
#: The device fields every command takes as flags (the model pool and ledger: environment only).
DEVICE_FIELDS = tuple(DeviceFields.model_fields)


# ========================================================================================== tuning
class Tuning(SettingsModel):
    """The libraries' other knobs, by group, each checked against the library's own dataclass (the
    pure policies keep taking those): `pool` (`memory_pool.pool.PoolConfig`), `store`
    (`comm.config.StoreConfig`, but PA and AM: the switches), `memory` (`api_proxy.proxy_memory.
    MemoryOptions`: `t_interval_s`, `headroom_bytes`, periods). Environment:
    `STREAMBOX_POOL__CHUNK_BYTES=4194304`, `STREAMBOX_STORE__CAPACITY_FRACTION=0.3`."""

    pool: dict[str, Any] = Field(default_factory=env_group("pool"))
    store: dict[str, Any] = Field(default_factory=env_group("store"))
    memory: dict[str, Any] = Field(default_factory=env_group("memory"))

    @model_validator(mode="after")
    def _check_groups(self) -> Tuning:
        if self.pool:
            self.pool_config()
        if self.store:
            self.store_base()
        if self.memory:
            self.memory_base()
        return self

    def pool_config(self) -> Any:
        """`PoolConfig` with the `pool` group over its defaults."""
        from streambox.memory_pool.pool import PoolConfig

        return library_config(PoolConfig, self.pool, "pool")

    def store_base(self) -> StoreConfig:
        """`StoreConfig` with the `store` group over its defaults (PA and AM: `Mechanisms`)."""
        from streambox.comm.config import StoreConfig

        reserved = {"pressure_aware": "pa", "adaptive_movement": "am"}
        return library_config(StoreConfig, self.store, "store", reserved)

    def memory_base(self) -> Any:
        """`MemoryOptions` with the `memory` group over its defaults (the rest: `memory_options`)."""
        from streambox.api_proxy.proxy_memory import MemoryOptions

        reserved = {
            "mode": "pool_mode",
            "pool": "the pool group",
            "keep_alive_s": "weights_keep_alive_s",
            "recycler": "recycler",
        }
        return library_config(MemoryOptions, self.memory, "memory", reserved)

    def tuning(self) -> dict[str, dict[str, Any]]:
        """The groups given, each value as the library takes it (for the records), in plain types (a
        nested dataclass, the store's `quota`, as a dict: the records are JSON, the stats msgpack)."""
        built = (("pool", self.pool, self.pool_config), ("store", self.store, self.store_base),
                 ("memory", self.memory, self.memory_base))  # fmt: skip
        out = {}
        for name, group, make in built:
            if group:
                made = make()
                out[name] = {key: to_jsonable_python(getattr(made, key)) for key in group}
        return out


# =========================================================================================== runs
class RunOptions(SettingsModel):
    """What `serve`, `burst` and `replay` share besides the device and the mechanisms."""

    inputs: Literal["small", "full"] = Field(
        default_factory=env_factory("inputs", "model_shapes", default="small"),
        description="small: the zoo's small input shapes (fast on CPU cores) | full: the YAML's",
    )
    completion: Literal["poll", "sync"] | None = Field(
        default_factory=env_factory("completion"),
        description="the proxy's completion: poll (event polling, default) | sync (stream sync)",
    )
    channel: Literal["shm", "zmq"] | None = Field(
        default_factory=env_factory("channel"),
        description="the proxy's forwarding channel: shm (default) | zmq",
    )

    @field_validator("inputs", "completion", "channel", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return words(value)


RUN_FIELDS = tuple(RunOptions.model_fields)


# ==================================================================================== environment
class Settings(BaseSettings, DeviceFields, Mechanisms, RunOptions, Tuning):
    """The environment over the whole tree: `STREAMBOX_<FIELD>` (e.g. `STREAMBOX_DEVICE_MODE=timed`,
    `STREAMBOX_PA=off`, `STREAMBOX_MODEL_SHAPES=full` for `inputs`)."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", frozen=True, extra="ignore", validate_default=True
    )

    # `STREAMBOX_MODEL_SHAPES` is the former name of `STREAMBOX_INPUTS` (what the proxy loads for).
    inputs: Literal["small", "full"] = Field(
        "small",
        validation_alias=AliasChoices("streambox_inputs", "streambox_model_shapes"),
        description=RunOptions.model_fields["inputs"].description,
    )
    model_pool: Path = Field(default_factory=default_model_pool)
    state_dir: Path | None = None

    @classmethod
    def from_env(cls) -> Settings:
        return build(cls, "environment (STREAMBOX_*)")

    def config(self, **defaults: Any) -> Config:
        """The device configuration; `defaults` fill what the environment left unset."""
        fields = set(Config.model_fields) & set(type(self).model_fields)  # not per-runtime ones
        given = {name: getattr(self, name) for name in fields if name in self.model_fields_set}
        base = {name: getattr(self, name) for name in fields}
        return build(Config, "environment", **{**base, **defaults, **given})


#: `STREAMBOX_*` variables read outside `Settings`, each where it is used (the emulated device's
#: framework runtime, nvcc's path, the heap freeze, the proxy's control-key pipe).
OTHER_ENVIRONMENT = (
    "MODEL_SHAPES", "FRAMEWORK_MEMORY", "FRAMEWORK_INIT_S", "NVCC", "FREEZE_HEAP", "CONTROL_KEY_FD",
    "SLOW_TESTS",  # the test suite's own (tests/kernel_compiler)
)


def _known_names() -> list[str]:
    return sorted({name.upper() for name in Settings.model_fields} | set(OTHER_ENVIRONMENT))


def _unread(name: str, known: Sequence[str]) -> bool:
    """Whether `name` is a `STREAMBOX_*` variable that nothing reads."""
    rest = name.upper().removeprefix(ENV_PREFIX)
    groups = tuple(f"{group.upper()}__" for group in Tuning.model_fields)
    return rest != name.upper() and rest not in known and not rest.startswith(groups)


def unknown_environment(environ: Mapping[str, str]) -> list[str]:
    """A line for each `STREAMBOX_*` variable in `environ` that nothing reads (a misspelt
    `STREAMBOX_POOLMODE` ran the default silently), with the nearest name that is read."""
    known = _known_names()
    lines = []
    for name in environ:
        if _unread(name, known):
            rest = name.upper().removeprefix(ENV_PREFIX)
            close = difflib.get_close_matches(rest, known, n=1, cutoff=0.75)
            hint = f"; did you mean {ENV_PREFIX}{close[0]}?" if close else ""
            lines.append(f"{name} is not a setting StreamBox reads and changes nothing{hint}")
    return lines


#: `STREAMBOX_*` variables read that say where things are kept, how tools are found or which tests
#: run, not what runs.
WHERE_ENVIRONMENT = ("STATE_DIR", "MODEL_POOL", "NVCC", "CONTROL_KEY_FD", "SLOW_TESTS")


def settings_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The `STREAMBOX_*` variables in `environ` that change what runs (a mechanism, the device, a
    library knob; none that nothing reads), upper-cased: what a measurement taken under them must
    record."""
    known, where = _known_names(), {f"{ENV_PREFIX}{name}" for name in WHERE_ENVIRONMENT}
    return {
        name.upper(): value.strip()
        for name, value in environ.items()
        if name.upper().startswith(ENV_PREFIX) and name.upper() not in where and not _unread(name, known)
    }


def ineffective_settings(settings: Mapping[str, Any]) -> list[str]:
    """A line for each switch a run's resolved tree (`Mechanisms.resolved`, `device`) sets that changes
    nothing in that run, so that an ablation measuring nothing says so where it runs (the proxy's log,
    the replay's stderr)."""
    gpus = (settings.get("device") or {}).get("gpus")
    if settings.get("am") is False and gpus == 1:
        return [
            "am=off changes nothing on one GPU: AM moves data to another GPU of the node before host "
            "memory, and there is none here (gpus 1); this run is the same as am=on (try --gpus 4)"
        ]
    return []


def system_default(environ: Mapping[str, str] | None = None) -> str:
    """The `--system` a command runs when not given one: `STREAMBOX_SYSTEM` (any case), else streambox."""
    environ = os.environ if environ is None else environ
    given = {name.upper(): value for name, value in environ.items()}.get(f"{ENV_PREFIX}SYSTEM")
    return given.strip().lower() if given and given.strip() else "streambox"


def env_default(name: str) -> Any:
    """A run option's value from the environment (or the tree's default), e.g. `inputs`."""
    return getattr(build(RunOptions, "environment (STREAMBOX_*)"), name)


__all__ = [
    "BACKENDS",
    "COMM_STORES",
    "DEVICE_FIELDS",
    "DEVICE_MODES",
    "ENV_PREFIX",
    "MECHANISM_FIELDS",
    "RUN_FIELDS",
    "Config",
    "DeviceFields",
    "Mechanisms",
    "RunOptions",
    "Settings",
    "SettingsError",
    "Tuning",
    "SettingsModel",
    "build",
    "check_keys",
    "default_model_pool",
    "env_default",
    "env_factory",
    "env_group",
    "library_config",
    "option_name",
    "settings_error",
]
