"""The systems under test (the paper's Table 2): `streambox`, `stream-only`, `infless` (formerly
`monolithic`) and `astraea`, each running the real workflow.

All run the same workflow (a shipped example such as Traffic, or a YAML file) through the same
workflow engine on the same arrivals; only the invoker below the engine differs:

- `streambox`: one API proxy process per workflow (`ProxyInvoker`): function instances forked from a
  warm template, one stream each; memory pool fm+rs, IO daemon, communication store in GPU memory.
- `stream-only`: the same proxy with StreamBox's mechanisms off (static caching pool, FIFO copies):
  the paper's ablation preset. Runtime sharing is what is left.
- `infless`: one process and one device runtime per function instance, each an MPS client with a
  share of the compute units (`gpu_percent`), its own model copy, pre-warmed, keep-alive,
  intermediate data through Redis (`workflows.monolithic.MonolithicInvoker`). `monolithic` is its
  old name, kept for one release with a deprecation line.
- `astraea`: infless's instances (same invoker, same start-up, same MPS shares), but data passed by
  CUDA-IPC handle with the intermediate data cached in the producer's GPU memory until its consumers
  are done or its request ends (`workflows.monolithic_ipc`; open/close costs modelled, no Redis).

Each request is a seeded synthetic input of the workflow (`workflows.examples.sample_event`), the
same for every system. The trace decides when requests come, not what they compute.

Memory is read where nvidia-smi would read it: every run gets an emulated device ledger of its own
(a fresh state directory), so the device's used bytes are exactly this system's runtimes, pools and
contexts. Components (contexts, weights, other allocated data, cached pool bytes) come from what the
proxies or instances report.

Options (`--set KEY=VALUE`, or the same names as flags: `--pa off`), common to all:
  `inputs`       small | full: the zoo's small input shapes (default; what 2 CPU cores can replay in
                 minutes) or the YAML's realistic sizes. Weights are full size either way.
  `keep_alive_s` how long an idle instance stays warm. Default: the paper's 10 minutes in trace time,
                 i.e. 600 s times the replay's time compression (`--minute-seconds` / 60).
  `variants`     how many different synthetic inputs are cycled through (default 4).
  the device     `backend`, `device_preset`, `gpus`, `device_mode` (default `timed` here).
  `prewarm`      instances per function started at deploy (default 1, every system: the paper warms
                 the baselines up, section 9; the proxies fork theirs from the warm template).
Proxy systems also take the mechanisms (`pool_mode`, `io_daemon`, `rz`, `pb`, `bt`, `pa`, `am`,
`recycler`, `weights_keep_alive_s`) and `completion`, `channel` (docs/api_proxy.md); `infless`
and `astraea` take `gpu_percent`.
config.json's `system_config` holds the resolved `settings` of the run.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import sys
import tempfile
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from streambox.config import DEVICE_FIELDS, Config, SettingsModel, build, env_default, option_name
from streambox.workflows.engine import Engine
from streambox.workflows.invoker import Invoker
from streambox.workflows.spec import WorkflowSpec

from .target import COUNTER_PREFIX, WORKFLOW_MEMORY_PREFIX, Outcome, SystemRequest
from .tenants import tenant_of, tenant_spec_name

#: The paper's keep-alive (10 minutes of trace time).
PAPER_KEEP_ALIVE_S = 600.0
COMMON_OPTIONS = ("inputs", "keep_alive_s", "variants")
#: Instances per function every system starts at deploy unless `--set prewarm=N` says otherwise: the
#: paper warms the systems up (section 9), the proxies and the per-instance systems alike.
DEFAULT_PREWARM = 1


def proxy_startup(prewarm: int) -> str:
    """What deploying a proxy system does before the first request (each run's `settings.startup`)."""
    if prewarm == 0:
        return "deploy loads the models into the proxy; function instances fork at their first request"
    return (
        f"deploy loads the models into the proxy and forks {prewarm} instance(s) per function "
        "from its template"
    )

#: The device a replay runs on unless told otherwise: timed, so that GPU time is modelled.
REPLAY_DEVICE_DEFAULTS = {"device_mode": "timed"}


class WorkflowOptions(SettingsModel):
    """What every workflow-running system takes from `--set`; the rest goes to the invoker."""

    inputs: Literal["small", "full"] = Field(default_factory=lambda: env_default("inputs"))
    keep_alive_s: float = Field(PAPER_KEEP_ALIVE_S, ge=0, allow_inf_nan=False)  # travels as JSON: no inf
    variants: int = Field(4, ge=1, le=64)  # each is built at the start (a Traffic event: ~300 KB)

    @classmethod
    def split(
        cls, system: str, options: Mapping[str, str], time_scale: float
    ) -> tuple[WorkflowOptions, dict[str, str], dict[str, str]]:
        """(common options, device fields, the invoker's own options); errors name the key."""
        given = {option_name(k): v for k, v in options.items()}
        common = {k: given.pop(k) for k in COMMON_OPTIONS if k in given}
        device = {k: given.pop(k) for k in DEVICE_FIELDS if k in given}
        common.setdefault("keep_alive_s", PAPER_KEEP_ALIVE_S * time_scale)
        return build(cls, system, **common), device, given


def load_workflow(name: str, small: bool) -> tuple[WorkflowSpec, Callable[[int], dict[str, Any]]]:
    """A shipped example by name (traffic, image-processing, social-media) or a YAML file, and a
    seeded input maker. A YAML file that is not an example must say how to make inputs: it gets the
    Traffic-style image event (`{"image": ...}`), which is what the example handlers read."""
    from streambox.workflows.examples import EXAMPLES, load_example, sample_event
    from streambox.workflows.validation import validate_file

    base, tenant = tenant_of(name)
    if tenant is not None:  # `traffic@2`: a deployment of its own (replay/tenants.py)
        spec, make = load_workflow(base, small)
        return spec.model_copy(update={"name": tenant_spec_name(spec.name, tenant)}), make
    if name in EXAMPLES:
        return load_example(name, small=small), lambda seed: sample_event(name, seed)
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"workflow {name!r} is neither a shipped example ({', '.join(EXAMPLES)}) nor a file")
    return validate_file(path), lambda seed: sample_event("traffic", seed)


class WorkflowTarget:
    """A `Target` that runs real workflow requests through the engine over one system's invoker."""

    def __init__(
        self,
        name: str,
        request: SystemRequest,
        make_invoker: Callable[[Config, WorkflowOptions, dict[str, str]], Invoker],
        memory: Callable[[Invoker], dict[str, float]],
        settings: Callable[[WorkflowOptions, dict[str, str]], dict[str, Any]],
    ) -> None:
        self.name = name
        self.request = request
        self.options, self.device_options, self.invoker_options = WorkflowOptions.split(
            name, request.options, request.time_scale
        )
        # Checked now, before the run starts: the device, and the system's resolved settings.
        environment = Config.from_env(**REPLAY_DEVICE_DEFAULTS).model_dump()
        self.device = build(Config, name, **{**environment, **self.device_options})
        device = self.device.resolved()
        device.pop("state_dir")  # every run gets a ledger of its own (see `start`)
        self.settings = {
            **settings(self.options, self.invoker_options),
            **self.options.model_dump(),
            "device": device,
        }
        self._make_invoker = make_invoker
        self._memory = memory
        self._state_dir: Path | None = None
        self._config: Config | None = None
        self._backend: Any = None
        self._engine: Engine | None = None
        self._inputs: dict[str, list[dict[str, Any]]] = {}
        # Loaded (and validated) now, so that a bad workflow fails before the run writes anything.
        small = self.options.inputs == "small"
        self._loaded = {workflow: load_workflow(workflow, small) for workflow in request.workflows}
        self._specs: dict[str, WorkflowSpec] = {}
        self._context_bytes = 0

    async def start(self) -> None:
        # A ledger of its own: the device's used bytes are this system's and nothing else's.
        self._state_dir = Path(tempfile.mkdtemp(prefix=f"sbx-replay-{self.name}-"))
        self._config = self.device.with_overrides(state_dir=self._state_dir / "state")
        self._backend = self._config.open_backend()
        spec = getattr(self._backend, "spec", None)
        self._context_bytes = int(getattr(spec, "context_memory", 0))
        for workflow, (spec_, make) in self._loaded.items():
            self._specs[workflow] = spec_
            self._inputs[workflow] = [make(seed) for seed in range(self.options.variants)]
        invoker = self._make_invoker(self._config, self.options, self.invoker_options)
        self._engine = Engine(invoker)
        try:
            # The warm-up ends when the replay starts, not at each workflow's own deploy: the deploys
            # after one may outlast a time-compressed keep-alive (workflows/invoker.py, pin_warm).
            pin_warm = getattr(invoker, "pin_warm", None)
            for spec_ in self._specs.values():
                await self._engine.deploy(spec_)
                if pin_warm is not None:
                    await pin_warm(spec_.name, True)
            for spec_ in self._specs.values() if pin_warm is not None else ():
                await pin_warm(spec_.name, False)
            refresh = getattr(invoker, "refresh_stats", None)
            if refresh is not None:  # the first sample already sees what deploying loaded
                await refresh()
        except BaseException:
            await self.close()
            raise

    async def send(self, workflow: str, event: dict[str, Any]) -> Outcome:
        if self._engine is None:
            raise RuntimeError(f"{self.name}: send() before start()")
        spec = self._specs.get(workflow)
        if spec is None:
            deployed = list(self._specs)
            raise KeyError(f"{self.name}: workflow {workflow!r} is not deployed; deployed: {deployed}")
        inputs = self._inputs[workflow]
        request = inputs[int(event.get("request_id", 0)) % len(inputs)]
        result = await self._engine.run(spec.name, request)
        return Outcome(
            latency_s=result.latency_s,
            status=result.status,
            cold_start=result.cold_starts > 0,
            error=None if result.ok else f"{result.failed_call or ''}: {result.error}".lstrip(": "),
            phases=result.phases(),
        )

    def sample(self) -> dict[str, float]:
        if self._backend is None or self._engine is None:
            return {}
        usage = self._backend.device_usage()
        used = float(sum(u.used_memory for u in usage))
        runtimes = sum(u.runtimes for u in usage)
        parts = self._memory(self._engine.invoker)
        for spec in self._specs.values():  # a workflow with no runtime now (its proxy stopped) holds 0
            parts.setdefault(f"{WORKFLOW_MEMORY_PREFIX}{spec.name}", 0.0)
        sample = {
            "memory_used_bytes": used,
            "runtimes": float(runtimes),
            "streams": float(sum(u.streams for u in usage)),
            "memory.context_bytes": float(runtimes * self._context_bytes),
        }
        reserved, allocated = parts.pop("pool_reserved_bytes", None), parts.pop("pool_used_bytes", None)
        weights = parts.pop("weights_bytes", None)
        if reserved is not None and allocated is not None:
            sample["pool_bytes"] = reserved
            sample["demand_bytes"] = allocated
            sample["memory.cached_bytes"] = max(reserved - allocated, 0.0)
            if weights is not None:
                sample["memory.weights_bytes"] = weights
                sample["memory.data_bytes"] = max(allocated - weights, 0.0)
        sample.update(parts)
        return sample

    async def refresh(self) -> None:
        """The invoker's periodic figures (the proxies' `stats`) read again now (`Target.refresh`)."""
        refresh = getattr(self._engine.invoker, "refresh_stats", None) if self._engine else None
        if refresh is not None:
            await refresh()

    def describe(self) -> dict[str, Any]:
        invoker = self._engine.invoker if self._engine is not None else None
        described = getattr(invoker, "describe", None)
        last_stats = getattr(invoker, "last_stats", None)
        last = last_stats() if callable(last_stats) else {}
        reported = {workflow: stats["settings"] for workflow, stats in last.items() if "settings" in stats}
        return {
            "target": self.name,
            "inputs": self.options.inputs,
            "keep_alive_s": self.options.keep_alive_s,
            "variants": self.options.variants,
            "invoker_options": dict(self.invoker_options),
            "device": (self.device.backend, self.device.device_preset),
            "settings": self.settings,
            "invoker": described() if callable(described) else type(invoker).__name__,
            # each proxy's own `stats.settings`: what ran, beside `settings`, what the replay asked for
            **({"reported_settings": reported} if reported else {}),
        }

    async def close(self) -> None:
        engine, self._engine = self._engine, None
        if engine is not None:
            await engine.close()
        if self._state_dir is not None:
            await asyncio.to_thread(shutil.rmtree, self._state_dir, True)
            self._state_dir = None


# -- streambox and stream-only: the API proxy -------------------------------------------------------


def _proxy_invoker(system: str) -> Callable[[Config, WorkflowOptions, dict[str, str]], Invoker]:
    def make(config: Config, options: WorkflowOptions, rest: dict[str, str]) -> Invoker:
        from streambox.workflows.proxy_invoker import ProxyInvoker

        # The proxy loads its models at start for the shapes the requests will bring.
        proxy_options = {
            "model_shapes": options.inputs,
            "prewarm": DEFAULT_PREWARM,
            **_proxy_options(system, rest),
        }
        max_per_device = proxy_options.pop("max_proxies_per_device", None)
        return ProxyInvoker(
            config,
            system=system,
            max_proxies_per_device=max_per_device,
            keep_alive_s=options.keep_alive_s,
            stats_period_s=0.25,
            proxy_options=proxy_options,
        )

    return make


class ProxyStartup(SettingsModel):
    """The proxy systems' start-up options: `prewarm` named as infless's and astraea's; a count cap
    on warm proxies per GPU on top of admission by memory (the paper's: 3)."""

    prewarm: int = Field(DEFAULT_PREWARM, ge=0, description="instances per function forked at deploy")
    max_proxies_per_device: int | None = Field(
        None, ge=1, description="warm proxies per GPU at most (default: as many as fit in its memory)"
    )


def _proxy_options(system: str, options: Mapping[str, str]) -> dict[str, Any]:
    """`--set` strings to ProxyConfig fields (errors name the system, the key and what is allowed)."""
    from streambox.api_proxy.proxy_config import ablation_options

    given = {option_name(k): v for k, v in options.items()}
    startup = {k: given.pop(k) for k in ProxyStartup.model_fields if k in given}
    try:
        own = build(ProxyStartup, "proxy option", **startup).model_dump(exclude_unset=True)
        return {**ablation_options(given), **own}
    except ValueError as error:
        named = set(re.findall(r"\w+", str(error)))
        others = [k for k in (*ProxyStartup.model_fields, *COMMON_OPTIONS, *DEVICE_FIELDS) if k not in named]
        also = f"; the replay's --set also takes {', '.join(others)}" if "unknown" in named else ""
        raise ValueError(f"{system}: {error}{also}") from None


def _proxy_settings(system: str) -> Callable[[WorkflowOptions, dict[str, str]], dict[str, Any]]:
    """The proxy's mechanisms resolved as its `stats` will report them (`Mechanisms.resolved`)."""

    def resolve(options: WorkflowOptions, rest: dict[str, str]) -> dict[str, Any]:
        from streambox.config import Mechanisms, Tuning

        parsed = _proxy_options(system, rest)
        mechanisms = {k: v for k, v in parsed.items() if k in Mechanisms.model_fields}
        built = build(Mechanisms, system, system=system, **mechanisms)
        resolved = built.resolved()
        keep = built.weights_keep_alive_s  # --set, else `STREAMBOX_WEIGHTS_KEEP_ALIVE_S` (as the proxy)
        return {
            **resolved,
            "startup": proxy_startup(parsed.get("prewarm", DEFAULT_PREWARM)),
            "prewarm": parsed.get("prewarm", DEFAULT_PREWARM),
            "max_proxies_per_device": parsed.get("max_proxies_per_device"),
            "weights_keep_alive_s": options.keep_alive_s if keep is None else keep,
            "completion": parsed.get("completion") or env_default("completion") or "poll",
            "channel": parsed.get("channel") or env_default("channel") or "shm",
            # the library knobs the proxy takes from the environment (`STREAMBOX_MEMORY__PROFILES`)
            "tuning": build(Tuning, system).tuning(),
        }

    return resolve


def _proxy_memory(invoker: Invoker) -> dict[str, float]:
    """Pool, weights and instances summed over the invoker's proxies, as they reported last."""
    totals = {"pool_reserved_bytes": 0.0, "pool_used_bytes": 0.0, "weights_bytes": 0.0, "instances": 0.0}
    for workflow, stats in invoker.last_stats().items():  # type: ignore[attr-defined]
        # the proxy's runtime: its context and every byte it allocated (pool, weights, store)
        totals[f"{WORKFLOW_MEMORY_PREFIX}{workflow}"] = float(stats["device"]["runtime_bytes"])
        totals["pool_reserved_bytes"] += stats["pool"]["reserved_bytes"]
        totals["pool_used_bytes"] += stats["pool"]["allocated_bytes"]
        totals["weights_bytes"] += stats.get("models_resident_bytes", 0)
        totals["instances"] += sum(f["instances"] for f in stats["functions"].values())
        profiles = stats.get("profiles", {})  # fm+rs: runs Algorithm 1 saw with / without a profile
        totals["profiled_runs"] = totals.get("profiled_runs", 0.0) + profiles.get("profiled_runs", 0)
        totals["unprofiled_runs"] = totals.get("unprofiled_runs", 0.0) + profiles.get("unprofiled_runs", 0)
        counts = {
            **_prefixed("pool", stats["pool"]["counters"]),
            **_prefixed("io", stats.get("io", {})),
            **_prefixed("store", stats.get("store", {})),  # PA and AM at work: moves, spills, reclaims
            **_prefixed("proxy", stats.get("process", {})),
            **_prefixed("proxy.thread_cpu_s", stats.get("process", {}).get("threads", {})),
            **_prefixed("proxy.thread_runs", stats.get("process", {}).get("thread_runs", {})),
        }
        for key, value in counts.items():
            totals[key] = totals.get(key, 0.0) + float(value)
    return totals


def _prefixed(part: str, counters: Mapping[str, Any]) -> dict[str, float]:
    """A proxy's counters as sample columns (`counter.pool.grows`), numbers only."""
    return {
        f"{COUNTER_PREFIX}{part}.{k}": float(v)
        for k, v in counters.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


def make_streambox_target(request: SystemRequest) -> WorkflowTarget:
    return WorkflowTarget(
        "streambox", request, _proxy_invoker("streambox"), _proxy_memory, _proxy_settings("streambox")
    )


def make_stream_only_target(request: SystemRequest) -> WorkflowTarget:
    return WorkflowTarget(
        "stream-only", request, _proxy_invoker("stream-only"), _proxy_memory, _proxy_settings("stream-only")
    )


# -- infless (and its old name, monolithic) and astraea: a process, a runtime and an MPS share per --
# -- instance; data through Redis (infless) or by CUDA-IPC handle (astraea) -------------------------


class MonolithicOptions(SettingsModel):
    """`infless`'s and `astraea`'s own options (no proxy, so none of the mechanisms)."""

    # The paper warms the baselines up ("the significant latency of cold start could cause all
    # requests to time out", section 9), as the proxies load their models at deploy: one instance
    # per function is up before the first request.
    prewarm: int = Field(
        DEFAULT_PREWARM, ge=0, description="instances per function started before the first request"
    )
    gpu_percent: int | None = Field(
        None, ge=1, le=100, description="each instance's MPS share; default: 100 / the workflow's functions"
    )


def _monolithic_options(system: str, rest: Mapping[str, str]) -> MonolithicOptions:
    unknown = sorted(set(rest) - set(MonolithicOptions.model_fields))
    if unknown:
        known = (*MonolithicOptions.model_fields, *COMMON_OPTIONS, *DEVICE_FIELDS)
        raise ValueError(f"{system}: unknown options {unknown}; known: {', '.join(known)}")
    return build(MonolithicOptions, system, **rest)


def _monolithic_invoker(
    system: str, data_path: str
) -> Callable[[Config, WorkflowOptions, dict[str, str]], Invoker]:
    def make(config: Config, options: WorkflowOptions, rest: dict[str, str]) -> Invoker:
        from streambox.workflows.monolithic import MonolithicInvoker

        own = _monolithic_options(system, rest)
        return MonolithicInvoker(
            config,
            keep_alive_s=options.keep_alive_s,
            prewarm=own.prewarm,
            model_shapes=options.inputs,
            gpu_percent=own.gpu_percent,
            data_path=data_path,
        )

    return make


def _monolithic_settings(
    system: str, data_path: str
) -> Callable[[WorkflowOptions, dict[str, str]], dict[str, Any]]:
    def resolve(options: WorkflowOptions, rest: dict[str, str]) -> dict[str, Any]:
        own = _monolithic_options(system, rest)
        startup = f"deploy starts {own.prewarm} instance(s) per function: process, runtime and models"
        return {"system": system, "data_path": data_path, "startup": startup, **own.model_dump()}

    return resolve


def _monolithic_memory(invoker: Invoker) -> dict[str, float]:
    parts = dict(invoker.memory_breakdown())  # type: ignore[attr-defined]
    parts.pop("context_bytes", None)  # counted from the ledger's runtimes, as for the proxies
    by_workflow = invoker.memory_by_workflow()  # type: ignore[attr-defined]
    return {
        **{k: float(v) for k, v in parts.items()},
        **{f"{WORKFLOW_MEMORY_PREFIX}{w}": float(v) for w, v in by_workflow.items()},
    }


def _per_instance_target(name: str, request: SystemRequest, system: str, data_path: str) -> WorkflowTarget:
    return WorkflowTarget(
        name,
        request,
        _monolithic_invoker(system, data_path),
        _monolithic_memory,
        _monolithic_settings(system, data_path),
    )


def make_infless_target(request: SystemRequest) -> WorkflowTarget:
    return _per_instance_target("infless", request, "infless", "redis")


def make_astraea_target(request: SystemRequest) -> WorkflowTarget:
    return _per_instance_target("astraea", request, "astraea", "cuda-ipc")


#: `monolithic` is `infless` under its old name, kept for one release.
MONOLITHIC_DEPRECATED = (
    "replay system 'monolithic' is deprecated: it is 'infless' now (the name goes next release)"
)


_warned: set[str] = set()  # the deprecation line once per process (options are checked before the run)


def make_monolithic_target(request: SystemRequest) -> WorkflowTarget:
    warnings.warn(MONOLITHIC_DEPRECATED, DeprecationWarning, stacklevel=2)
    if "monolithic" not in _warned:
        _warned.add("monolithic")
        print(f"warning: {MONOLITHIC_DEPRECATED}", file=sys.stderr)
    return _per_instance_target("monolithic", request, "infless", "redis")
