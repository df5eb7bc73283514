"""The `paper` subcommand: arguments (argparse only, no torch) and the handler."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

#: The paper's evaluation figures, in order; those without a builder say why.
ALL_FIGURES = ("12", "13", "14", "15", "16", "17", "18", "19")


def add_paper_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "figures",
        nargs="+",
        metavar="FIGURE",
        help=f"{', '.join(ALL_FIGURES)} or all (several share one replay comparison)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="CI-sized: Traffic only (and Traffic-b16 for figure 12), three requests per system, the "
        "benchmarks' --quick",
    )
    p.add_argument("--out", type=Path, default=Path("runs/paper"), help="output folder (default runs/paper)")
    p.add_argument(
        "--systems",
        help="comma-separated systems (default: Table 2's that the replay registry knows, streambox first)",
    )
    p.add_argument(
        "--reuse",
        action="store_true",
        help="build the tables from the measurements already in --out (same size), measuring only "
        "what is missing",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="figures 12-14: replay the comparison this many times (by turns) and add, per factor "
        "StreamBox / baseline, its median over the runs and each run's value (default 1; figure 12's "
        "comparison at batch 16 runs once)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(handler=cmd_paper)


def _wanted(figures: list[str]) -> list[str]:
    wanted = []
    for figure in figures:
        for item in ALL_FIGURES if figure == "all" else [figure.removeprefix("fig")]:
            if item not in ALL_FIGURES:
                raise ValueError(f"figure {figure!r} is not one of {', '.join(ALL_FIGURES)}, all")
            if item not in wanted:
                wanted.append(item)
    return wanted


def cmd_paper(args: argparse.Namespace) -> int:
    """Build each figure asked for; print its table. Exit 3 when a figure asked for by name could not be
    built (the reason is printed), 0 otherwise."""
    from ..run import check_out_folder
    from .figures import FIGURES, MISSING
    from .session import FigureUnavailable, Session, paper_systems

    wanted = _wanted(args.figures)
    systems = paper_systems()
    if args.systems is not None:
        systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
        if not systems or len(set(systems)) < len(systems):
            raise ValueError(f"--systems must name each system once, comma-separated; got {args.systems!r}")
        others = [s for s in systems if s not in paper_systems()]
        if others:  # the paper's numbers are Table 2's systems'; found now, not after the replays
            raise ValueError(
                f"--systems: {', '.join(others)} not among Table 2's systems that the replay knows "
                f"({', '.join(paper_systems())}; infless was once called monolithic)"
            )
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    check_out_folder(args.out)
    session = Session(
        args.out, args.quick, systems, progress=not args.no_progress, reuse=args.reuse, repeats=args.repeats
    )
    not_built = []
    for figure in wanted:
        try:
            if figure not in FIGURES:
                raise FigureUnavailable(MISSING.get(figure, "no builder yet"))
            result = FIGURES[figure](session)
        except FigureUnavailable as why:
            not_built.append(figure)
            print(f"figure {figure}: NOT BUILT: {why}", file=sys.stderr, flush=True)
            continue
        print((result.folder / "table.md").read_text(), flush=True)
        print(f"figure {figure}: {result.folder}/", flush=True)
    explicit = [f for f in not_built if "all" not in args.figures]
    return 3 if explicit else 0
