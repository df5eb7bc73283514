"""The `replay` and `report` subcommands, ready to be added to the `streambox` command line:

    from streambox.replay.cli import add_commands
    add_commands(commands)   # commands = parser.add_subparsers(...)

Each sets `handler` (cmd_replay, or "streambox.replay.cli:cmd_report": args -> exit status), as the
other subcommands do.
`python -m streambox.replay {replay,report} ...` runs them on their own.

Every field of the settings tree (`streambox.config`: the device, the mechanisms, the run options) is
both a flag (`--pa off`) and a system option (`--set pa=off`), with the same names as `serve` and
`burst`; a flag and a `--set` of the same key must agree.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from streambox.config import Config, option_name, system_default
from streambox.flags import DEVICE, MECHANISMS, RUN, add_setting_flags, flag_of, given_settings
from streambox.settings_base import SettingsError

from .choices import MAPPINGS, PATTERNS, SELECTIONS, SPACINGS
from .target import PLANNED_SYSTEMS, known_systems

if TYPE_CHECKING:
    from .run import RunResult


def _pairs(values: Sequence[str] | None, flag: str) -> dict[str, str]:
    result = {}
    for value in values or ():
        key, sep, item = value.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} takes KEY=VALUE, got {value!r}")
        key = key.strip()
        if key in result:
            raise ValueError(f"{flag} {key} given twice ({result[key]!r}, then {item.strip()!r})")
        result[key] = item.strip()
    return result


_TRUE, _FALSE = {"on", "true", "yes", "1"}, {"off", "false", "no", "0"}


def _same_value(a: str, b: str) -> bool:
    """Whether two spellings of a setting mean the same: `pa=false` and `--pa off`, `01` and `1`."""
    a, b = a.strip().lower(), b.strip().lower()
    if a == b or {a, b} <= _TRUE or {a, b} <= _FALSE:
        return True
    try:
        return float(a) == float(b)
    except ValueError:
        return False


def _csv(values: Sequence[str] | None) -> tuple[str, ...]:
    return tuple(part.strip() for value in values or () for part in value.split(",") if part.strip())


def system_options(args: argparse.Namespace) -> dict[str, str]:
    """`--set KEY=VALUE` items and the settings flags given, as one mapping of the tree's names."""
    options: dict[str, str] = {}
    for key, value in _pairs(args.set, "--set").items():
        name = option_name(key)
        if name in options:
            raise ValueError(f"--set {name} given twice ({options[name]!r}, then {value!r})")
        options[name] = value
    for name, value in given_settings(args, RUN, MECHANISMS, DEVICE).items():
        if not _same_value(options.setdefault(name, value), value):
            raise ValueError(f"{flag_of(name)} {value} and --set {name}={options[name]} disagree")
    return options


def add_replay_arguments(p: argparse.ArgumentParser) -> None:
    systems = ", ".join(sorted(set(known_systems()) | set(PLANNED_SYSTEMS)))
    p.add_argument(
        "--trace", help="trace file or folder (2019 invocations [+ durations, memory], or a 2021 log)"
    )
    p.add_argument(
        "--workflow",
        default="traffic",
        help="workflow, or several separated by commas (default traffic); NAME*N deploys N tenants of "
        "NAME, each its own proxy or instances (traffic*3)",
    )
    p.add_argument(
        "--system", default=system_default(),
        help=f"system under test: {systems} (default streambox, or STREAMBOX_SYSTEM); several, "
        "comma-separated, replay the same workload on each into --out/<system> and report them side by "
        "side in --out/report",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="a system option: any flag below by its name (pa=off, pool_mode=fm, device_mode=functional), "
        "or inputs, keep_alive_s, variants, prewarm (docs/replay.md)",
    )
    p.add_argument("--minutes", type=int, default=10, help="trace minutes to replay (default 10)")
    p.add_argument("--start-minute", type=int, default=0, help="first trace minute (default 0)")
    p.add_argument("--scale", type=float, default=1.0, help="rate scale: 0.1 keeps every 10th invocation")
    p.add_argument("--minute-seconds", type=float, default=60.0,
                   help="replay seconds per trace minute (default 60 = real time; 0.5 = 120x faster)")
    p.add_argument("--functions", type=int, default=12, help="functions to replay (default 12)")
    p.add_argument("--select", choices=SELECTIONS, default="volume", help="how to choose them")
    p.add_argument("--pattern", action="append", help=f"keep only these patterns: {', '.join(PATTERNS)}")
    p.add_argument("--include", action="append", help="a function to replay in any case (app/function hash)")
    p.add_argument("--mapping", choices=MAPPINGS, default="round-robin", help="functions to workflows")
    p.add_argument("--map", action="append", metavar="FUNCTION=WORKFLOW", help="explicit mapping entry")
    p.add_argument("--spacing", choices=SPACINGS, default="poisson", help="arrivals inside a minute")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ms", type=float, default=200.0, help="latency SLO (default 200 ms, the paper's)")
    p.add_argument("--max-requests", type=int, help="send at most this many requests")
    p.add_argument("--max-duration", type=float, help="send no request after this many seconds")
    p.add_argument("--request-timeout", type=float, help="a request without outcome after this is a timeout")
    p.add_argument("--drain-timeout", type=float, default=60.0, help="wait for outstanding requests (s)")
    p.add_argument("--sample-interval", type=float, default=0.5, help="seconds between memory samples")
    p.add_argument("--out", help="run directory (default runs/<system>)")
    p.add_argument("--overwrite", action="store_true", help="replace a finished run in --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_setting_flags(p, RUN, MECHANISMS, DEVICE)
    p.set_defaults(handler=cmd_replay)


def add_commands(commands: argparse._SubParsersAction) -> None:
    """`replay` and `report` on a subparsers action (as `python -m streambox.replay` builds them)."""
    from streambox.cli import COMMANDS  # the one place the subcommands' arguments are defined

    for name in ("replay", "report"):
        summary, description, add_arguments = COMMANDS[name]
        add_arguments(commands.add_parser(name, help=summary, description=description))


def cmd_replay(args: argparse.Namespace) -> int:
    """One system: a run directory in --out. Several (--system a,b,c): one run each in --out/<system>,
    then the comparison plots and table in --out/report."""
    from streambox.device.modes import describe_device_mode

    from .report import print_run
    from .run import replay_device_mode, run_comparison, run_replay

    systems = _csv([args.system])
    if not systems:
        raise ValueError(f"--system {args.system!r} names no system; known: {', '.join(known_systems())}")
    explicit = _pairs(args.map, "--map")
    options = dict(
        workflow=args.workflow,
        minutes=args.minutes,
        scale=args.scale,
        start_minute=args.start_minute,
        minute_seconds=args.minute_seconds,
        functions=args.functions,
        select=args.select,
        patterns=_csv(args.pattern),
        include=_csv(args.include),
        mapping="explicit" if explicit else args.mapping,
        explicit_mapping=explicit,
        spacing=args.spacing,
        seed=args.seed,
        slo_ms=args.slo_ms,
        max_requests=args.max_requests,
        max_duration_s=args.max_duration,
        request_timeout_s=args.request_timeout,
        drain_timeout_s=args.drain_timeout,
        sample_interval_s=args.sample_interval,
        system_options=system_options(args),
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    backend = Config.from_env().backend  # $STREAMBOX_BACKEND: the proxies it starts read it too
    print(describe_device_mode(replay_device_mode(options["system_options"]), backend), flush=True)
    try:
        if len(systems) > 1:
            results, _ = run_comparison(systems, out=args.out or "runs/compare", trace=args.trace, **options)
            return _exit_status(results)
        result = run_replay(args.trace, system=systems[0], out=args.out or f"runs/{systems[0]}", **options)
    except SettingsError as error:
        raise SettingsError(_in_flags(str(error))) from None
    print_run(result.run_dir)
    return _exit_status([result])


#: `ReplayConfig` fields whose flag is not the field's name with dashes.
_FLAGS = {
    "workflows": "--workflow",
    "patterns": "--pattern",
    "explicit_mapping": "--map",
    "system_options": "--set",
    "max_duration_s": "--max-duration",
    "request_timeout_s": "--request-timeout",
    "drain_timeout_s": "--drain-timeout",
    "sample_interval_s": "--sample-interval",
}


def _in_flags(message: str) -> str:
    """`ReplayConfig: sample_interval_s 0.0 must be >= 0.01` as the command line says it:
    `--sample-interval 0.0 must be >= 0.01`."""
    lines = []
    for line in message.splitlines():
        rest = line.removeprefix("ReplayConfig: ")
        if rest != line:
            field, _, said = rest.partition(" ")
            line = f"{_FLAGS.get(field) or flag_of(field)} {said}"
        lines.append(line)
    return "\n".join(lines)


def _exit_status(results: Sequence[RunResult]) -> int:
    """130 (as a shell reports Ctrl-C) when the last run was interrupted: its files hold what was
    measured until then (`requests.stopped_by` "interrupted" in summary.json), nothing after it ran."""
    from .run import was_interrupted

    last = results[-1]
    if not was_interrupted(last.summary):
        return 0
    print(f"replay interrupted: {last.run_dir} holds the requests measured until then", file=sys.stderr)
    return 130


def cmd_report(args: argparse.Namespace) -> int:
    from .report import report

    out = args.out or str(Path(args.runs[0]).parent / "report")
    report(args.runs, out)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from streambox.cli import command_handler

    parser = argparse.ArgumentParser(prog="python -m streambox.replay")
    add_commands(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    try:
        return int(command_handler(args)(args))
    except ValueError as error:  # SettingsError included
        print(f"{parser.prog} {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
