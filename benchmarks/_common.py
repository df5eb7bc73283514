"""What every benchmark script shares: `--quick`, `--json PATH`, and a ratio table."""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a reduced run that finishes in about a minute")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the measured figures to PATH")
    return p


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    table = Table(title=title)
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(str(cell) for cell in row))
    Console(width=160).print(table)


def write_json(path: Path | None, name: str, config: dict[str, Any], results: Any) -> None:
    if path is None:
        return
    payload = {
        "benchmark": name,
        "config": config,
        "machine": {"python": sys.version.split()[0], "platform": platform.platform()},
        "results": results,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
    print(f"wrote {path}")
