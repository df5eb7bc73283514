"""What the figures of one `streambox paper` call share: the output folder, the size of the run, and the
measurements already taken (the replay comparison and each benchmark run once per call, whichever
figures ask for them)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streambox.config import settings_environment

from ..target import PLANNED_SYSTEMS, known_systems

#: The paper's workflows (Fig. 11), all bundled.
WORKFLOWS = ("traffic", "image-processing", "social-media")


def paper_systems() -> tuple[str, ...]:
    """The systems of Table 2 that the replay registry knows, StreamBox first (astraea joins when
    registered; `monolithic`, infless's old name, is left out)."""
    known = known_systems()
    return tuple(s for s in PLANNED_SYSTEMS if s in known and s != "monolithic")


@dataclass(frozen=True)
class ReplaySize:
    """How much of the shipped Azure sample is replayed, and on what."""

    workflows: tuple[str, ...]
    minutes: int
    scale: float
    functions: int
    minute_seconds: float = 1.0
    max_requests: int | None = None
    inputs: str = "small"

    def options(self) -> dict[str, Any]:
        return {
            "workflow": ",".join(self.workflows),
            "minutes": self.minutes,
            "scale": self.scale,
            "functions": self.functions,
            "minute_seconds": self.minute_seconds,
            "max_requests": self.max_requests,
            "select": "stratified",  # bursty, periodic and sporadic functions alike (replay/shaping.py)
            "slo_ms": 200.0,  # the paper's SLO
            "system_options": {"inputs": self.inputs},
        }


#: The paper-sized run that fits minutes on 2 cores: the three workflows, every arrival pattern, the
#: workflows' realistic input sizes (activations are what a static pool keeps and FM frees: with the
#: zoo's small inputs demand is almost all resident weights, and the pools cannot differ), at the
#: sample's own rate (at half of it, 2.6 req/s, no system was loaded: every one's throughput was the
#: offered rate, and the paper's throughput figure had nothing to show).
FULL = ReplaySize(WORKFLOWS, minutes=30, scale=1.0, functions=6, inputs="full")
#: CI-sized: one workflow, a handful of requests.
QUICK = ReplaySize(("traffic",), minutes=10, scale=0.5, functions=3, max_requests=3)

#: Fig. 12 again at the paper's batch size (section 3 takes Traffic at batch 16): FULL with Traffic's
#: recognitions batched 16 (`traffic-b16`), on the same arrivals, StreamBox and stream-only only: the
#: systems whose pools differ (a static pool keeps each plan's activations at the largest batch it ran;
#: the per-instance systems fill the 16 GB device at this batch, docs/reproduction.md).
BATCH16 = ReplaySize(("traffic-b16", *WORKFLOWS[1:]), minutes=30, scale=1.0, functions=6, inputs="full")
QUICK_BATCH16 = ReplaySize(("traffic-b16",), minutes=10, scale=0.5, functions=3, max_requests=3)
BATCH16_SYSTEMS = ("streambox", "stream-only")

#: Fig. 19: users (tenants) of Traffic sharing one GPU, each its own deployment; two trace functions a
#: user, so that every user has its own arrivals.
TENANT_USERS = (3, 6)
QUICK_TENANT_USERS = (2, 3)


def tenant_size(users: int, quick: bool) -> ReplaySize:
    """The replay of `users` tenants of Traffic (replay/tenants.py: `traffic*N`)."""
    if quick:
        return ReplaySize(
            (f"traffic*{users}",), minutes=10, scale=0.5, functions=users, max_requests=3 * users
        )
    return ReplaySize((f"traffic*{users}",), minutes=10, scale=0.5, functions=2 * users)


#: The benchmarks' arguments beyond --quick --json under `paper --quick` (CI-sized: seconds, not a minute).
SMOKE_ARGS: dict[str, tuple[str, ...]] = {
    "bench_memory_pool": ("--functions", "3", "--duration", "6", "--ab-reps", "1"),
    "bench_comm": ("--repeats", "3", "--rounds", "1"),
    "bench_io_daemon": ("--repeats", "1"),
    "bench_compile": ("--models", "resnet18", "--batches", "1", "--no-nvcc"),
    "bench_forwarding": ("--levels", "1,4,8"),
}


class FigureUnavailable(RuntimeError):
    """A figure that cannot be built here (the message says what is missing)."""


def benchmarks_dir() -> Path | None:
    """The repository's benchmarks/ folder (beside the package's sources), None in an installed copy."""
    here = Path(__file__).resolve().parents[2] / "benchmarks"
    return here if (here / "_common.py").exists() else None


def _json_value(path: Path) -> object:
    """What a measurement's JSON file holds; None where it cannot be read (damaged, gone): --reuse
    then measures again instead of failing."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _json_object(path: Path) -> dict | None:
    value = _json_value(path)
    return value if isinstance(value, dict) else None


@dataclass
class Session:
    out: Path
    quick: bool
    systems: tuple[str, ...]
    progress: bool = True
    reuse: bool = False  # take the measurements already in `out` when they are of the same size
    repeats: int = 1  # replay comparisons for figures 12-14: the first, then out/replay-2, ...
    load_at_start: tuple[float, float, float] = field(default_factory=os.getloadavg)
    _comparison: dict[str, Path] | None = field(default=None, init=False)
    _tenants: dict[int, dict[str, Path]] = field(default_factory=dict, init=False)
    _benchmarks: dict[str, Path] = field(default_factory=dict, init=False)
    _repeats: dict[Path, dict[str, Path]] = field(default_factory=dict, init=False)
    _batch16: dict[str, Path] | None = field(default=None, init=False)
    _reused: list[str] = field(default_factory=list, init=False)  # what --reuse took (for the tables' note)
    _measured: bool = field(default=False, init=False)  # whether this session measured anything
    _labelled: dict[str, str] = field(default_factory=dict, init=False)  # run folder -> an ablation's label

    @property
    def size(self) -> ReplaySize:
        return QUICK if self.quick else FULL

    def comparison(self) -> dict[str, Path]:
        """system -> run directory of the one replay comparison (out/replay/<system>), run on first use;
        the report's plots go to out/replay/report."""
        if self._comparison is None:
            self._comparison = self._compare(self.out / "replay", self.size)
        return self._comparison

    def repeated_comparisons(self) -> list[dict[str, Path]]:
        """`repeats` replay comparisons of the same size and arrivals: `comparison()` first, then
        out/replay-2, ... (run on first use, by turns of whole comparisons): the spread of a factor
        between runs on a shared host, and its median."""
        runs = [self.comparison()]
        while len(runs) < self.repeats:
            folder = self.out / f"replay-{len(runs) + 1}"
            self._repeats[folder] = self._repeats.get(folder) or self._compare(folder, self.size)
            runs.append(self._repeats[folder])
        return runs

    @property
    def batch16_size(self) -> ReplaySize:
        return QUICK_BATCH16 if self.quick else BATCH16

    def batch16(self) -> dict[str, Path]:
        """system -> run directory of the comparison at the paper's batch size (out/replay-b16/<system>):
        those of BATCH16_SYSTEMS this session replays, run on first use."""
        if self._batch16 is None:
            systems = tuple(s for s in self.systems if s in BATCH16_SYSTEMS)
            self._batch16 = self._compare(self.out / "replay-b16", self.batch16_size, systems)
        return self._batch16

    def tenants(self, users: int) -> dict[str, Path]:
        """system -> run directory of `users` tenants of Traffic on one GPU (out/tenants<N>/<system>)."""
        if users not in self._tenants:
            self._tenants[users] = self._compare(self.out / f"tenants{users}", tenant_size(users, self.quick))
        return self._tenants[users]

    def _compare(
        self, folder: Path, size: ReplaySize, systems: Sequence[str] | None = None
    ) -> dict[str, Path]:
        """Every system (default: the session's) replayed on the same arrivals of `size` into
        folder/<system> (report plots in folder/report), or the runs already there under --reuse."""
        systems = self.systems if systems is None else tuple(systems)
        reused = self._reused_comparison(folder, size, systems) if self.reuse else None
        if reused is not None:
            return reused
        from ..run import run_comparison, was_interrupted

        self._measured = True
        results, _ = run_comparison(
            systems, out=folder, overwrite=True, progress=self.progress, **size.options()
        )
        if was_interrupted(results[-1].summary):
            raise KeyboardInterrupt(f"the replay comparison in {folder} was interrupted")  # no figure of it
        from ..run import run_label

        for r in results:
            system_config = _json_object(r.run_dir / "config.json") or {}
            asked = run_label(r.config, system_config.get("system_config") or {}, environ={})
            self._note_label(r.run_dir, str(r.summary.get("label")), asked)
        return {r.config.system: r.run_dir for r in results}

    def _note_label(self, run_dir: Path, label: str, asked: str) -> None:
        if label != asked:  # options the figure did not ask for (STREAMBOX_<NAME>): an ablation
            self._labelled[self.relative(run_dir)] = label

    def runs_note(self, sources: Iterable[str] = ()) -> list[str]:
        """What ran under a system's name with options of its own (an ablation set in the environment,
        `STREAMBOX_POOL_MODE=static`), among the runs a table's `sources` (files, relative to `out`)
        were read from: its rows are that run's, not the system's as the paper ran it."""
        sources = list(sources)
        read = {Path(source).parent.as_posix() for source in sources}
        labelled = sorted(self._labelled.items())
        return [
            label if run in sources else f"the rows from {run} are {label}'s"
            for run, label in labelled
            if run in read or run in sources
        ]

    def _reused_comparison(
        self, folder: Path, size: ReplaySize, systems: Sequence[str] | None = None
    ) -> dict[str, Path] | None:
        """The comparison already in `folder` when every system has a finished run that measured what
        this one would: the same system with the same options and environment switches (its label),
        and the same replay configuration but for where it was written."""
        from ..run import replay_config, run_label, same_measurement, was_interrupted
        from ..target import SystemRequest, resolve_system

        runs = {}
        for system in self.systems if systems is None else systems:
            run_dir = folder / system
            if not (run_dir / "summary.json").exists():
                print(f"not reusing {folder}: no finished run of {system}", flush=True)
                return None
            summary, stored = _json_object(run_dir / "summary.json"), _json_object(run_dir / "config.json")
            if summary is None or stored is None or not isinstance(stored.get("config"), dict):
                print(f"not reusing {run_dir}: its summary.json or config.json cannot be read", flush=True)
                return None
            if was_interrupted(summary):
                print(f"not reusing {folder}: the run of {system} was interrupted", flush=True)
                return None
            wanted = replay_config(system=system, out=run_dir, **size.options())
            differ = same_measurement(stored["config"], wanted)
            request = SystemRequest(system, tuple(wanted.workflows), options=dict(wanted.system_options))
            described = resolve_system(system, request).describe()
            label = run_label(wanted, described)
            if stored.get("label") != label:
                differ.append(f"label {stored.get('label')!r}, not {label!r}")
            if differ:
                print(f"not reusing {run_dir}: it measured another run ({', '.join(differ)})", flush=True)
                return None
            runs[system] = run_dir
            self._note_label(run_dir, str(stored.get("label")), run_label(wanted, described, environ={}))
        print(f"reusing the replay comparison in {folder}", flush=True)
        self._reused.append(self.relative(folder))
        return runs

    def machine_note(self) -> str:
        """The host's load, which the replays' latencies follow on a shared machine; what --reuse took
        from the output folder instead of measuring, whose host load is not recorded."""
        reused = (
            f"rebuilt from measurements already in the output folder (--reuse: {', '.join(self._reused)}): "
            "the host load when they were taken is not recorded here"
        )
        if self._reused and not self._measured:
            return reused
        now = os.getloadavg()
        host = (
            f"host: {os.cpu_count()} cores, load average (1 min) {self.load_at_start[0]:.1f} at the start, "
            f"{now[0]:.1f} when this table was written"
        )
        return f"{host}; partly {reused}" if self._reused else host

    def relative(self, path: Path) -> str:
        return str(path.relative_to(self.out))

    def benchmark(self, name: str) -> Path:
        """Run benchmarks/<name>.py --quick --json once (their full sizes take most of an hour; under
        `paper --quick` also SMOKE_ARGS); its JSON lands in out/bench/<name>.json and its printed tables
        in out/bench/<name>.txt."""
        if name in self._benchmarks:
            return self._benchmarks[name]
        folder = benchmarks_dir()
        if folder is None:
            raise FigureUnavailable(f"{name} needs the repository's benchmarks/ folder (a source checkout)")
        target = self.out / "bench" / f"{name}.json"
        args = ["--quick", *(SMOKE_ARGS.get(name, ()) if self.quick else ())]
        # The arguments and the switches the environment sets (it reaches the benchmark's proxies and
        # pools), for --reuse and for the tables' notes.
        ran = {"args": args, "environment": settings_environment(os.environ)}
        given = target.with_suffix(".args.json")
        if self.reuse and target.exists() and given.exists() and _json_value(given) != ran:
            print(f"not reusing {target}: it ran with other arguments or STREAMBOX_* switches "
                  f"({_json_value(given)}, not {ran})", flush=True)
        elif self.reuse and target.exists() and given.exists():
            print(f"reusing {target}", flush=True)
            self._reused.append(self.relative(target))
            self._note_environment(target, ran["environment"])
            self._benchmarks[name] = target
            return target
        self._measured = True
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)
        command = [sys.executable, str(folder / f"{name}.py"), *args, "--json", str(target)]
        print(f"running {' '.join(command[1:])}", flush=True)
        done = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ))
        (target.with_suffix(".txt")).write_text(done.stdout + done.stderr)
        if done.returncode != 0 or not target.exists():
            tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
            raise FigureUnavailable(f"{name} failed (exit {done.returncode}): " + " | ".join(tail))
        given.write_text(json.dumps(ran))
        self._note_environment(target, ran["environment"])
        self._benchmarks[name] = target
        return target

    def _note_environment(self, target: Path, environment: Mapping[str, str]) -> None:
        if environment:  # an ablation set in the environment: the benchmark's rows are not the system's
            listed = " ".join(f"{k}={v}" for k, v in sorted(environment.items()))
            where = self.relative(target)
            self._labelled[where] = f"the rows from {where} were measured with {listed}"

    def bench_results(self, name: str) -> dict[str, Any]:
        return json.loads(self.benchmark(name).read_text())["results"]

    def bench_command(self, name: str) -> str:
        """The command line `benchmark(name)` ran (run once), for a table's notes: what was measured."""
        path = self.benchmark(name)
        args = (_json_object(path.with_suffix(".args.json")) or {}).get("args", ["--quick"])
        return " ".join([f"benchmarks/{name}.py", *args])

    def bench_config(self, name: str) -> dict[str, Any]:
        """The configuration `benchmark(name)` reported in its JSON (its sizes as run)."""
        return json.loads(self.benchmark(name).read_text()).get("config", {})

    def copy_plots(self, names: Sequence[str], into: Path, replay: str = "replay") -> list[Path]:
        """The plots `names` of the report of out/`replay` copied into a figure's folder."""
        into.mkdir(parents=True, exist_ok=True)
        report = self.out / replay / "report"
        copied = []
        for name in names:
            source = report / f"{name}.png"
            if source.exists():
                copied.append(Path(shutil.copy(source, into / source.name)))
        return copied
