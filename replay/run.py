"""`run_replay`: trace -> chosen functions -> arrivals -> open-loop run against a system -> run directory.

    run_replay(None, workflow="traffic", system="streambox", minutes=10, scale=0.1, out="runs/x")

replays minutes [0, 10) of the shipped sample (`replay/data/azure2019-sample`, real Azure 2019 rows) at
a tenth of its rate against the system registered as "streambox", and writes runs/x/{config.json,
requests.csv, samples.csv, summary.json}.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import shutil
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path
from typing import Any

from pydantic import ConfigDict, Field, TypeAdapter, ValidationInfo, field_validator

from streambox.config import Config, SettingsModel, ineffective_settings, option_name
from streambox.device.modes import device_mode_env
from streambox.gc_pauses import frozen_heap
from streambox.settings_base import ENV_PREFIX

from .driver import INTERRUPTED, drive
from .metrics import summarize, write_json, write_requests, write_samples
from .shaping import (
    MAPPINGS,
    PATTERNS,
    SELECTIONS,
    SPACINGS,
    Arrival,
    Chosen,
    build_arrivals,
    choose_functions,
    map_to_workflows,
    scale_counts,
    stable_seed,
)
from .target import FunctionProfile, SystemRequest, Target, resolve_system
from .tenants import expand_tenants
from .traces import Trace, load_trace

SAMPLE_NAME = "azure2019-sample"


def sample_trace() -> Path:
    """The trace sample shipped with the package (see replay/data/ATTRIBUTION.md)."""
    return Path(str(resources.files("streambox.replay") / "data" / SAMPLE_NAME))


class ReplayConfig(SettingsModel):
    """Every knob of a run; written whole to config.json. Checked on construction: a mistake raises
    `SettingsError` (a ValueError) naming the field, the value and what is allowed."""

    model_config = ConfigDict(allow_inf_nan=False)  # `--scale inf`: a mistake, named as one

    trace: str | None = None  # a trace file or folder; None = the shipped sample
    workflows: tuple[str, ...] = Field(("traffic",), min_length=1)
    system: str = "streambox"
    out: str = "runs/replay"
    minutes: int = Field(10, ge=1)  # trace minutes replayed, from start_minute
    start_minute: int = Field(0, ge=0)
    scale: float = Field(1.0, gt=0)  # rate scale: 0.1 keeps every 10th invocation (cumulative rounding)
    minute_seconds: float = Field(60.0, gt=0)  # replay seconds per trace minute (60 = real time)
    functions: int = Field(12, ge=1)  # how many functions to replay
    select: str = "volume"  # volume | random | stratified
    patterns: tuple[str, ...] = ()  # keep only these patterns (sporadic, periodic, bursty)
    include: tuple[str, ...] = ()  # functions to replay in any case
    mapping: str = "round-robin"  # round-robin | stripe | explicit
    explicit_mapping: dict[str, str] = Field(default_factory=dict)
    spacing: str = "poisson"  # poisson | even | trace (2021 timestamps)
    seed: int = Field(0, ge=0, lt=2**32)  # numpy's seeds
    slo_ms: float = Field(200.0, gt=0)  # the paper's SLO for Traffic
    max_requests: int | None = Field(None, ge=1)
    max_duration_s: float | None = Field(None, gt=0)
    request_timeout_s: float | None = Field(None, gt=0)
    drain_timeout_s: float = Field(60.0, ge=0)
    sample_interval_s: float = Field(0.5, ge=0.01)  # each sample reads every runtime's stats
    system_options: dict[str, Any] = Field(default_factory=dict)  # --set KEY=VALUE, to the system
    overwrite: bool = False
    progress: bool = True

    @field_validator("workflows")
    @classmethod
    def _tenants_expanded(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return expand_tenants(value)  # `traffic*3`: three tenants (replay/tenants.py)

    @field_validator("select", "mapping", "spacing", "patterns")
    @classmethod
    def _known_choice(cls, value: Any, info: ValidationInfo) -> Any:
        allowed = {"select": SELECTIONS, "mapping": MAPPINGS, "spacing": SPACINGS, "patterns": PATTERNS}
        for item in value if isinstance(value, tuple) else (value,):
            if item not in allowed[info.field_name]:
                raise ValueError(f"is not one of {', '.join(allowed[info.field_name])}")
        return value


#: Settings the environment also sets under another name (`Config`'s `inputs` is `model_shapes` too).
ENV_ALIASES: dict[str, tuple[str, ...]] = {"inputs": ("model_shapes",)}


def _replay_device() -> dict[str, str]:
    """The device a replay runs on unless told otherwise: `Config`'s defaults, timed (where the
    models are kept is left out: it changes no measurement)."""
    from .systems import REPLAY_DEVICE_DEFAULTS  # systems registers targets, which import this module

    fields = ("backend", "device_preset", "gpus", "device_mode", "framework_runtime")
    defaults = {k: Config.model_fields[k].get_default(call_default_factory=False) for k in fields}
    return {k: str(v) for k, v in {**defaults, **REPLAY_DEVICE_DEFAULTS}.items()}


def _environment_values(
    settings: Mapping[str, Any], given: Mapping[str, Any], environ: Mapping[str, str]
) -> list[tuple[str, str, str, Any]]:
    """(key, the variable, its value, the resolved value) of each setting that `environ` names
    (`STREAMBOX_<NAME>`, any case, or an alias) and `--set` does not: the settings the environment
    reads (`Settings`), and the device's where unlike the replay's own device."""
    from streambox.config import Settings, Tuning

    named = {option_name(k) for k in given}
    upper = {name.upper(): value for name, value in environ.items()}  # as the settings read it
    device = settings.get("device")  # the device's settings sit one level down: those unlike the
    device = device if isinstance(device, Mapping) else {}  # replay's own (the emulated V100, timed)
    plain = _replay_device()
    read = set(Settings.model_fields) - {"system", "device", *Tuning.model_fields}  # the groups: by key
    keys = [(k, settings[k]) for k in settings if k in read]
    keys += [(k, v) for k, v in device.items() if k in plain and str(v) != plain[k]]
    found = []
    for key, value in keys:
        if key in named:
            continue
        for spelling in (key, *ENV_ALIASES.get(key, ())):
            variable = f"{ENV_PREFIX}{spelling.upper()}"
            raw = upper.get(variable)
            if raw is not None:
                found.append((key, variable, raw, value))
                break
    return found


def _agrees(resolved: Any, raw: str) -> bool:
    """Whether a setting resolved to what the environment's `raw` value says (the environment
    reached the run, rather than a value the replay sets itself)."""
    text = raw.strip().lower()
    if resolved is None:
        return text in ("", "none")
    if isinstance(resolved, bool):  # every spelling the settings take (`t`, `n`, `off`, ...)
        try:
            return TypeAdapter(bool).validate_python(text) is resolved
        except ValueError:
            return False
    if isinstance(resolved, int | float):
        try:
            return float(text) == float(resolved)
        except ValueError:
            return False
    return text == str(resolved).strip().lower()


def shown(value: Any) -> str:
    """A resolved setting as a label writes it: `on`/`off` for switches, else its text."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))  # 60, not 60.0, as it is given
    return str(value)


def environment_options(
    settings: Mapping[str, Any], given: Mapping[str, Any], environ: Mapping[str, str]
) -> dict[str, str]:
    """The switches among a system's resolved `settings` that `environ` set and `--set` did not
    (`STREAMBOX_<NAME>`, as the README documents for every flag; the library knobs of `tuning` as
    `group.key`): part of what ran, so part of the run's label, so that an ablation made that way is
    not reported as the system itself. Only values that reached the run, as they resolved; one the
    replay sets itself is `environment_ignored`."""
    found = {key: shown(value) for key, _, raw, value in _environment_values(settings, given, environ)
             if _agrees(value, raw)}
    tuning = settings.get("tuning")  # only `environ` sets them
    upper = {name.upper() for name in environ}
    for group, values in (tuning if isinstance(tuning, Mapping) else {}).items():
        for key, value in values.items():
            if f"{ENV_PREFIX}{group.upper()}__{key.upper()}" in upper:
                found[f"{group}.{key}"] = shown(value)
    return found


def environment_ignored(
    settings: Mapping[str, Any], given: Mapping[str, Any], environ: Mapping[str, str]
) -> list[str]:
    """What the environment sets that the run does not take (the replay sets it itself), one line each."""
    return [
        f"{variable}={raw} is set, but this run takes {key}={shown(value)} (the replay sets it; use --set "
        f"{key}=...)"
        for key, variable, raw, value in _environment_values(settings, given, environ)
        if not _agrees(value, raw)
    ]


@dataclass
class Workload:
    trace: Trace
    chosen: list[Chosen]
    mapping: dict
    arrivals: list[Arrival]
    window_s: float


@dataclass
class RunResult:
    run_dir: Path
    summary: dict[str, Any]
    config: ReplayConfig


def build_workload(config: ReplayConfig) -> Workload:
    """Load, choose, map and shape: everything before a target is involved (pure but for the read)."""
    trace = load_trace(config.trace if config.trace is not None else sample_trace())
    end = config.start_minute + config.minutes
    if not trace.functions:
        raise ValueError(f"{config.trace or SAMPLE_NAME} holds no function's invocations (a header alone?)")
    if end > trace.minutes:
        raise ValueError(
            f"trace minutes [{config.start_minute}, {end}) run past the end of "
            f"{config.trace or SAMPLE_NAME}, which has {trace.minutes} minutes: "
            "lower --start-minute or --minutes"
        )
    chosen = choose_functions(
        trace.functions,
        config.functions,
        by=config.select,
        patterns=config.patterns or None,
        start_minute=config.start_minute,
        minutes=config.minutes,
        seed=config.seed,
        include=config.include,
    )
    if not chosen:
        raise ValueError(
            f"no function of {config.trace or SAMPLE_NAME} has invocations in trace minutes "
            f"[{config.start_minute}, {config.start_minute + config.minutes}) with patterns "
            f"{list(config.patterns) or 'any'}"
        )
    if len(chosen) < config.functions:  # said, not silent: the run's rate is that of fewer functions
        print(
            f"replay: {len(chosen)} functions of {config.trace or SAMPLE_NAME} have invocations in trace "
            f"minutes [{config.start_minute}, {config.start_minute + config.minutes})"
            f"{' with patterns ' + ','.join(config.patterns) if config.patterns else ''}; replaying those "
            f"{len(chosen)}, not the {config.functions} asked for (--functions)",
            file=sys.stderr,
        )
    keys = [c.key for c in chosen]
    mapping = map_to_workflows(keys, config.workflows, config.mapping, config.explicit_mapping)
    arrivals = build_arrivals(
        chosen,
        mapping,
        start_minute=config.start_minute,
        minutes=config.minutes,
        rate_scale=config.scale,
        minute_seconds=config.minute_seconds,
        spacing=config.spacing,
        seed=config.seed,
        max_requests=config.max_requests,  # generated lazily: memory follows the bounds
        max_duration_s=config.max_duration_s,
    )
    if not arrivals:
        raise ValueError(
            f"no arrival left after scaling {sum(int(c.window_counts.sum()) for c in chosen)} invocations "
            f"by {config.scale}; raise --scale or --minutes"
        )
    return Workload(trace, chosen, mapping, arrivals, config.minutes * config.minute_seconds)


def _profiles(workload: Workload) -> tuple[FunctionProfile, ...]:
    result = []
    for item in workload.chosen:
        duration = workload.trace.duration(item.key)
        memory = workload.trace.memory(item.key)
        result.append(
            FunctionProfile(
                str(item.key),
                workload.mapping[item.key],
                item.pattern.kind,
                item.series.trigger,
                duration.percentiles_ms[3] if duration else None,
                memory.average_mb if memory else None,
            )
        )
    return tuple(result)


def _event_factory(workload: Workload, seed: int):
    """Events carry the function's trace facts; duration_hint_ms is one seeded draw from its duration
    percentiles (for targets that want it; the systems under test run their real workflow)."""
    hints: dict[str, list[float]] = {}
    counts = Counter(a.function for a in workload.arrivals)
    for item in workload.chosen:
        duration = workload.trace.duration(item.key)
        count = counts[item.key]
        if duration is not None:
            hints[str(item.key)] = list(duration.sample_ms(stable_seed(seed, f"duration:{item.key}"), count))
    patterns = {str(c.key): c.pattern.kind for c in workload.chosen}
    cursor: dict[str, int] = {}

    def event(request_id: int, arrival: Arrival) -> dict[str, Any]:
        function = str(arrival.function)
        index = cursor.get(function, 0)
        cursor[function] = index + 1
        draws = hints.get(function)
        return {
            "request_id": request_id,
            "workflow": arrival.workflow,
            "function": function,
            "pattern": patterns[function],
            "minute": arrival.minute,
            "scheduled_s": arrival.time_s,
            "duration_hint_ms": draws[index] if draws else None,
        }

    return event


def _describe_workload(config: ReplayConfig, workload: Workload) -> dict[str, Any]:
    return {
        "trace_layout": workload.trace.layout,
        "trace_sources": workload.trace.sources,
        "trace_minutes": workload.trace.minutes,
        "trace_functions": len(workload.trace.functions),
        "window_s": workload.window_s,
        "arrivals": len(workload.arrivals),
        "functions": [
            {
                "key": str(c.key),
                "label": c.key.label(),
                "trigger": c.series.trigger,
                "workflow": workload.mapping[c.key],
                "window_invocations": int(c.window_counts.sum()),
                "replayed_invocations": int(scale_counts(c.window_counts, config.scale).sum()),
                "pattern": c.pattern.as_dict(),
            }
            for c in workload.chosen
        ],
    }


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "platform": platform.platform()}
    for package in ("streambox", "numpy", "matplotlib", "rich"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions


async def _drive(
    target: Target, workload: Workload, config: ReplayConfig, on_started: Callable[[], None] | None = None
):
    """`drive` between the target's start and close; `on_started()` after the start and again once the
    requests are done, before the close (what the system reported while it ran)."""
    await target.start()
    stop = asyncio.Event()
    try:
        if on_started is not None:
            on_started()
        with _interruptible(stop):
            result = await drive(
                target,
                workload.arrivals,
                slo_s=config.slo_ms / 1e3,
                max_requests=config.max_requests,
                max_duration_s=config.max_duration_s,
                request_timeout_s=config.request_timeout_s,
                drain_timeout_s=config.drain_timeout_s,
                sample_interval_s=config.sample_interval_s,
                event_for=_event_factory(workload, config.seed),
                progress=config.progress,
                stop=stop,
            )
        if on_started is not None:
            on_started()
        return result
    finally:
        await target.close()


@contextlib.contextmanager
def _interruptible(stop: asyncio.Event) -> Iterator[None]:
    """While a replay sends: Ctrl-C (SIGINT) or SIGTERM sets `stop` (the driver stops sending and the run
    keeps what it measured) instead of raising through the event loop; a second one stops it at once.
    Only where the loop can take signal handlers (the main thread)."""
    loop = asyncio.get_running_loop()
    taken = []
    for sig in (signal.SIGINT, signal.SIGTERM):

        def once(sig: signal.Signals = sig) -> None:
            if stop.is_set():  # asked twice: the default action, now
                loop.remove_signal_handler(sig)
                signal.raise_signal(sig)
                return
            print(f"\nreplay: {sig.name}: stopping, writing what was measured", file=sys.stderr, flush=True)
            stop.set()

        try:
            loop.add_signal_handler(sig, once)
            taken.append(sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or no such support
            break
    try:
        yield
    finally:
        for sig in taken:
            loop.remove_signal_handler(sig)


def execute(config: ReplayConfig, target: Target | None = None) -> RunResult:
    """Run one replay as configured. `target` overrides the registry (tests, notebooks)."""
    return asyncio.run(execute_async(config, target))


async def execute_async(config: ReplayConfig, target: Target | None = None) -> RunResult:
    """`execute` for callers that already run an event loop. The run's device mode is exported to the
    environment while it runs, so that every process the system starts follows it."""
    with device_mode_env(replay_device_mode(config.system_options)):
        return await _execute(config, target)


def replay_device_mode(system_options: Mapping[str, Any]) -> str:
    """A replay's device mode: its `device_mode` option, else the environment's, else timed."""
    from .systems import REPLAY_DEVICE_DEFAULTS  # systems registers targets, which import this module

    given = system_options.get("device_mode")
    return str(given) if given else Config.from_env(**REPLAY_DEVICE_DEFAULTS).device_mode


async def _execute(config: ReplayConfig, target: Target | None) -> RunResult:
    workload = build_workload(config)
    if target is None:
        request = SystemRequest(
            config.system, tuple(config.workflows), _profiles(workload), dict(config.system_options),
            config.seed, config.slo_ms / 1e3, config.minute_seconds / 60.0,
        )
        target = resolve_system(config.system, request)
    run_dir = Path(config.out)
    check_out_folder(run_dir)
    if (run_dir / _ASIDE).is_dir():  # an --overwrite killed (kill -9) before it measured: its previous run
        _put_back(run_dir / _ASIDE, run_dir)
    held = held_run(run_dir)
    if held and not config.overwrite:
        raise ValueError(f"{run_dir} already holds a run ({held}); choose another --out or --overwrite")
    run_dir.mkdir(parents=True, exist_ok=True)
    aside = _set_aside(run_dir)
    measured: list[bool] = []  # set once the replay has measured: from then on the new run stands
    try:
        return await _record(config, target, workload, run_dir, measured)
    except BaseException:
        if aside is not None and not measured:  # stopped before it measured (e.g. Ctrl-C while deploying)
            _put_back(aside, run_dir)
        raise
    finally:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)


def held_run(run_dir: Path) -> str | None:
    """The file that says `run_dir` holds a run --overwrite would replace: a finished one's summary, or
    the requests of one that measured before it stopped; None when it holds none."""
    return next((name for name in ("summary.json", "requests.csv") if (run_dir / name).exists()), None)


#: The files a run writes into its folder (docs/replay.md): what `--overwrite` replaces.
RUN_FILES = ("config.json", "requests.csv", "samples.csv", "summary.json")
_ASIDE = ".previous-run"


def _set_aside(run_dir: Path) -> Path | None:
    """The previous run's files in `run_dir`, moved into a folder of their own (an --overwrite), so
    that a run that ends before it measured anything leaves the previous one whole (`_put_back`)."""
    previous = [name for name in RUN_FILES if (run_dir / name).exists()]
    if not previous:
        return None
    aside = run_dir / _ASIDE
    shutil.rmtree(aside, ignore_errors=True)
    aside.mkdir()
    for name in previous:
        os.replace(run_dir / name, aside / name)
    return aside


def _put_back(aside: Path, run_dir: Path) -> None:
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
        if (aside / name).exists():
            os.replace(aside / name, run_dir / name)
    shutil.rmtree(aside, ignore_errors=True)


async def _record(
    config: ReplayConfig, target: Target, workload: Workload, run_dir: Path, measured: list[bool]
) -> RunResult:
    """Run the replay into `run_dir`: config.json before the first request, the rest at its end."""
    system_config = target.describe()
    label = run_label(config, system_config)
    settings = system_config.get("settings") or {}
    ignored = environment_ignored(settings, config.system_options, os.environ)
    for line in [*ignored, *ineffective_settings(settings)]:
        print(f"note: {line}", file=sys.stderr, flush=True)
    described = {
        "config": config.model_dump(mode="json"),
        "label": label,
        "device_mode": replay_device_mode(config.system_options),
        "workload": _describe_workload(config, workload),
        "system_config": system_config,
        "versions": _versions(),
        "argv": sys.argv,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_json(run_dir / "config.json", described)

    def started() -> None:  # what only a started system knows (its invoker's costs, versions, shares,
        # the settings its proxies report)
        described["system_config"] = target.describe()
        write_json(run_dir / "config.json", described)

    with frozen_heap() as pauses:  # the driver's own collections would delay what it sends and times
        result = await _drive(target, workload, config, started)
        measured.append(True)
        driver_gc = pauses.counters()
    patterns = {str(c.key): c.pattern.kind for c in workload.chosen}
    write_requests(run_dir / "requests.csv", result.records, patterns)
    write_samples(run_dir / "samples.csv", result.samples)
    summary = {
        "label": label,
        "system": config.system,
        "workflows": list(config.workflows),
        **summarize(result, slo_s=config.slo_ms / 1e3, window_s=workload.window_s),
    }
    summary["driver"]["gc"] = driver_gc
    write_json(run_dir / "summary.json", summary)
    return RunResult(run_dir, summary, config)


def run_replay(trace: str | Path | None = None, *, target: Target | None = None, **options: Any) -> RunResult:
    """Replay the run `replay_config(trace, **options)` describes (its workflows, system, minutes, rate
    scale and output folder: see there) against `target`, or the registry's system of that name."""
    return execute(replay_config(trace, **options), target)


def replay_config(
    trace: str | Path | None = None,
    *,
    workflow: str | Sequence[str] = "traffic",
    system: str = "streambox",
    minutes: int = 10,
    scale: float = 1.0,
    out: str | Path = "runs/replay",
    **options: Any,
) -> ReplayConfig:
    """The `ReplayConfig` of replaying `minutes` of `trace` (None: the shipped sample) at `scale` times
    its rate against `system` on `workflow` (a name, "a,b", or a list), into the run directory `out`.
    Other keyword options are ReplayConfig's fields (start_minute, minute_seconds, functions, select,
    patterns, include, mapping, explicit_mapping, spacing, seed, slo_ms, max_requests, max_duration_s,
    request_timeout_s, drain_timeout_s, sample_interval_s, system_options, overwrite, progress)."""
    options = {name: value for name, value in options.items() if value is not None}  # None: default
    return ReplayConfig(
        trace=str(trace) if trace is not None else None,
        workflows=_workflow_names(workflow),
        system=system,
        minutes=minutes,
        scale=scale,
        out=str(out),
        **options,
    )


#: ReplayConfig fields that say where and how a run is written, not what it measured.
NOT_MEASURED = ("out", "overwrite", "progress")


def same_measurement(stored: Mapping[str, Any], config: ReplayConfig) -> list[str]:
    """The fields in which a run's stored config (config.json's `config`) differs from `config`, other
    than where it was written: empty when that run measured what `config` would."""
    wanted = config.model_dump(mode="json")
    return sorted(k for k, v in wanted.items() if k not in NOT_MEASURED and stored.get(k) != v)


def run_label(
    config: ReplayConfig, system_config: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> str:
    """The run's label: its system, with its `--set` options and the switches the environment
    (default: this process's) set, each named and written as the run resolved it (`--set
    Pool-Mode=FM+RS` is `pool_mode=fm+rs`)."""
    environ = os.environ if environ is None else environ
    settings = system_config.get("settings") or {}
    device = settings.get("device")
    resolved_values = {**(device if isinstance(device, Mapping) else {}), **settings}
    given = {}
    for key, value in config.system_options.items():
        name = option_name(key)
        resolved = resolved_values.get(name)
        agrees = name in resolved_values and _agrees(resolved, str(value))
        given[name] = shown(resolved) if agrees else str(value)
    options = {**environment_options(settings, config.system_options, environ), **given}
    listed = ",".join(f"{k}={v}" for k, v in sorted(options.items()))
    return f"{config.system}[{listed}]" if listed else config.system


def was_interrupted(summary: Mapping[str, Any]) -> bool:
    """Whether a run's summary says the user stopped it (Ctrl-C, SIGTERM) before it was done."""
    return summary.get("requests", {}).get("stopped_by") == INTERRUPTED


def check_out_folder(path: Path, flag: str = "--out") -> None:
    """Refuse an output folder that is a file, before anything runs."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file, not a folder")


def _workflow_names(workflow: str | Sequence[str]) -> tuple[str, ...]:
    """A name, "a,b", or a list: the workflows' names."""
    return tuple(w for w in (workflow.split(",") if isinstance(workflow, str) else workflow) if w)


def run_comparison(
    systems: Sequence[str],
    *,
    out: str | Path = "runs/compare",
    trace: str | Path | None = None,
    **options: Any,
) -> tuple[list[RunResult], dict[str, Any]]:
    """The same workload against each system in turn (out/<system>), then `report` into out/report:
    the README's main job. Options are run_replay's."""
    from .report import report

    if not systems:
        raise ValueError("no system to compare")
    if len(set(systems)) < len(systems):
        raise ValueError(f"a system is named twice in {', '.join(systems)}: each writes out/<system>")
    check_out_folder(Path(out))
    if not options.get("overwrite"):  # found now, not after the systems before it have replayed
        done = [(s, held) for s in systems if (held := held_run(Path(out) / s))]
        if done:
            raise ValueError(
                f"{', '.join(f'{Path(out) / s} ({held})' for s, held in done)} already hold(s) a run: "
                "choose another --out or --overwrite"
            )
    if options.get("target") is None:
        # Fail before the first run, not after it: an unknown system, or options one of them refuses
        # (e.g. `rz=off` where stream-only has no IO daemon).
        given = dict(options.get("system_options") or {})
        minute_seconds = float(options.get("minute_seconds") or ReplayConfig().minute_seconds)
        workflows = expand_tenants(_workflow_names(options.get("workflow") or "traffic"))
        for system in systems:
            resolve_system(
                system, SystemRequest(system, workflows, options=given, time_scale=minute_seconds / 60)
            )
    results = []
    for system in systems:
        results.append(run_replay(trace, system=system, out=Path(out) / system, **options))
        if was_interrupted(results[-1].summary):
            break  # the user stopped the comparison: the systems after this one do not run
    return results, report([r.run_dir for r in results], Path(out) / "report")
