"""`streambox --help` and every subcommand's `--help`: no torch (nor torchvision, aiohttp, zmq) is
imported, and each answers in under half a second, measured in a fresh interpreter as a user runs it."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import pytest

from streambox.cli import COMMANDS, build_parser

HEAVY = ("torch", "torchvision", "aiohttp", "zmq")
LIMIT_S = 0.5
# Runs `main([..., "--help"])` and reports which heavy modules it loaded.
PROBE = f"""
import json, sys
from streambox.cli import main
try:
    main(sys.argv[1:] + ["--help"])
except SystemExit:
    pass
print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]), file=sys.stderr)
"""


def _help(*command: str) -> tuple[float, list[str], str]:
    """Wall time of a fresh interpreter answering `streambox [COMMAND] --help`, the heavy modules it
    imported, and what it printed."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *command], capture_output=True, text=True, timeout=60, check=True
    )
    elapsed = time.perf_counter() - started
    return elapsed, json.loads(done.stderr.strip().splitlines()[-1]), done.stdout


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_imports_no_torch_and_answers_in_half_a_second(command: str) -> None:
    argv = [command] if command else []
    # Best of three: the machine's other load is not the command's cost.
    runs = [_help(*argv) for _ in range(3)]
    best = min(elapsed for elapsed, _, _ in runs)
    _, heavy, printed = runs[0]
    assert heavy == [], f"streambox {command} --help imported {heavy}"
    assert "usage: streambox" in printed
    assert best < LIMIT_S, f"streambox {command} --help took {best:.3f} s (best of 3), over {LIMIT_S} s"


def test_the_full_parser_has_every_commands_flags() -> None:
    """Built whole (as tests and docs tools do), every subcommand has its arguments."""
    parser = build_parser()
    for argv in (
        ["serve", "traffic", "--pa", "off", "--inputs", "full", "--device-mode", "timed"],
        ["burst", "traffic", "--pool-mode", "fm", "--rz", "off"],
        ["replay", "--am", "off", "--set", "pb=off", "--gpus", "2"],
    ):
        args = parser.parse_args(argv)
        assert callable(args.handler) or ":" in args.handler


def test_one_spelling_across_serve_burst_and_replay() -> None:
    """The settings flags are the same on the three commands."""
    parser = build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))

    def flags(name: str) -> set[str]:
        sub = subcommands.choices[name]
        return {option for action in sub._actions for option in action.option_strings if option != "-h"}

    shared = flags("serve") & flags("burst") & flags("replay")
    for flag in ("--pool-mode", "--recycler", "--io-daemon", "--rz", "--pb", "--bt", "--pa", "--am",
                 "--weights-keep-alive-s", "--inputs", "--completion", "--channel", "--device-mode",
                 "--backend", "--device-preset", "--gpus"):  # fmt: skip
        assert flag in shared, flag


def test_deprecated_input_flags_still_work_and_say_so(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser(["serve", "burst"])
    assert parser.parse_args(["serve", "traffic", "--small"]).inputs == "small"
    assert "--small is deprecated; use --inputs small" in capsys.readouterr().err
    assert parser.parse_args(["burst", "traffic", "--full-size"]).inputs == "full"
    assert "--full-size is deprecated; use --inputs full" in capsys.readouterr().err
