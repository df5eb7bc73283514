"""A figure's table: per row our number, read from a file the run wrote, beside the paper's, and the ratio.

Each row names its sources (a file under the figure run's folder and a key in it) and how `ours` follows
from them (`value`: the one source; `ratio`: the first over the second; `ratio_of_ratios`: (a/b) / (c/d);
`share_of_gain`: (a-b) / (a-c); `value_us`: seconds shown as microseconds), so that every number of a
table can be traced to, and checked against, the raw output it came from (`check_rows`).

Source keys: in a JSON file, a dotted path ("latency_ms.p50", "results.pressure.0.get_s"); in a CSV
file, "count:COLUMN=VALUE,..." (rows matching every pair) or "mean:COLUMN" / "mean:COLUMN|FILTER..."
(the column's mean over matching rows; "median:" likewise).
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..metrics import write_json
from .numbers import PaperNumber, paper_number

Formula = Literal["value", "value_us", "ratio", "ratio_of_ratios", "share_of_gain", "median_ratio"]


class TableError(ValueError):
    """A source that cannot be read (the message names the file and the key)."""


@dataclass(frozen=True)
class Source:
    file: str  # relative to the figure run's root folder
    key: str


@dataclass
class Row:
    metric: str  # what the row measures, in words
    ours: float | None
    unit: str  # "x" for a factor StreamBox / baseline, else the unit of the value
    sources: list[Source]
    formula: Formula = "value"
    paper_key: str | None = None
    provenance: str = "measured"  # or "modelled (<what models it>)"
    note: str = ""
    paper: PaperNumber | None = field(init=False)

    def __post_init__(self) -> None:
        self.paper = paper_number(self.paper_key) if self.paper_key else None
        if self.paper_key and self.paper is None:
            raise KeyError(f"no paper number {self.paper_key!r} in streambox.replay.paper.numbers")

    @property
    def ratio(self) -> float | None:
        """ours / paper, where both exist (1.0 = the paper's result)."""
        if self.ours is None or self.paper is None or not math.isfinite(self.ours) or self.paper.factor == 0:
            return None
        return self.ours / self.paper.factor


def _json_value(data: Any, path: str, where: str) -> float:
    value = data
    for part in path.split("."):
        if isinstance(value, list) and part.isdigit() and int(part) < len(value):
            value = value[int(part)]
        elif isinstance(value, dict) and part in value:
            value = value[part]
        else:
            raise TableError(f"{where}: no key {path!r} (stopped at {part!r})")
    if value is None:
        return math.nan
    if not isinstance(value, int | float):
        raise TableError(f"{where}: {path!r} is {value!r}, not a number")
    return float(value)


def _matches(row: dict[str, str], filters: str) -> bool:
    pairs = [p.split("=", 1) for p in filters.split(",") if p]
    return all(row.get(k) == v for k, v in pairs)


def _csv_value(path: Path, key: str, where: str) -> float:
    with open(path, newline="") as stream:
        rows = list(csv.DictReader(stream))
    op, _, rest = key.partition(":")
    if op == "count":
        return float(sum(_matches(r, rest) for r in rows))
    if op in ("mean", "median"):
        column, _, filters = rest.partition("|")
        values = [float(r[column]) for r in rows if _matches(r, filters) and r.get(column, "") != ""]
        if not values:
            return math.nan
        return statistics.fmean(values) if op == "mean" else statistics.median(values)
    raise TableError(f"{where}: CSV key {key!r} is not count:..., mean:... or median:...")


def read_source(root: Path, source: Source) -> float:
    """The number `source` names under `root` (nan for a JSON null or an empty mean)."""
    path = root / source.file
    where = f"{path} [{source.key}]"
    if not path.exists():
        raise TableError(f"{where}: file missing")
    if path.suffix == ".csv":
        return _csv_value(path, source.key, where)
    return _json_value(json.loads(path.read_text()), source.key, where)


def computed(root: Path, sources: Sequence[Source], formula: str) -> float:
    values = [read_source(root, s) for s in sources]
    if formula == "value":
        return values[0]
    if formula == "value_us":  # seconds in the file, microseconds in the table
        return values[0] * 1e6
    if formula == "ratio":
        return values[0] / values[1] if values[1] else math.nan
    if formula == "share_of_gain":  # (before - partial) / (before - after): how much of a gain one step gives
        whole = values[0] - values[2]
        return (values[0] - values[1]) / whole if whole else math.nan
    if formula == "ratio_of_ratios":
        first = values[0] / values[1] if values[1] else math.nan
        second = values[2] / values[3] if values[3] else math.nan
        return first / second if second else math.nan
    if formula == "median_ratio":  # sources in pairs (numerator, denominator), one pair per repeat
        if len(values) % 2:
            raise TableError(f"median_ratio needs (numerator, denominator) pairs, got {len(values)} sources")
        ratios = [n / d for n, d in zip(values[::2], values[1::2], strict=True) if d and math.isfinite(n / d)]
        return statistics.median(ratios) if ratios else math.nan
    raise TableError(f"unknown formula {formula!r}")


def row_from(
    root: Path,
    metric: str,
    unit: str,
    sources: Sequence[Source],
    formula: Formula = "value",
    **extra: Any,
) -> Row:
    """A row whose `ours` is read from its sources now (so it is what the files say)."""
    value = computed(root, sources, formula)
    return Row(metric, None if math.isnan(value) else value, unit, list(sources), formula, **extra)


def ratio_row(root: Path, metric: str, numerator: Source, denominator: Source, **extra: Any) -> Row:
    """A factor row: numerator / denominator."""
    return row_from(root, metric, "x", [numerator, denominator], "ratio", **extra)


def check_rows(root: Path, rows: Sequence[dict[str, Any]]) -> list[str]:
    """Problems of a written table (its JSON rows) against the files under `root`: [] when every
    number is what its sources say."""
    problems = []
    for row in rows:
        try:
            value = computed(root, [Source(**s) for s in row["sources"]], row["formula"])
        except TableError as error:
            problems.append(f"{row['metric']}: {error}")
            continue
        ours = row["ours"]
        if (ours is None) != math.isnan(value) or (
            ours is not None and not math.isclose(ours, value, rel_tol=1e-9)
        ):
            problems.append(f"{row['metric']}: table says {ours}, sources say {value}")
    return problems


def fmt(value: float | None, unit: str) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    if unit == "x":
        return f"{value:.2g}x" if value < 0.1 else f"{value:.2f}x ({(value - 1) * 100:+.0f}%)"
    if unit == "s" and value < 1:
        return f"{value * 1e6:.3g} us" if value < 1e-3 else f"{value * 1e3:.3g} ms"
    if unit == "B":  # shown in MiB; the JSON keeps the bytes
        return f"{value / (1 << 20):,.0f} MiB"
    if abs(value) >= 100:
        return f"{value:,.0f} {unit}"
    return f"{value:.3g} {unit}"


def as_dict(row: Row) -> dict[str, Any]:
    return {
        "metric": row.metric,
        "ours": row.ours,
        "unit": row.unit,
        "paper": row.paper.factor if row.paper else None,
        "paper_quote": row.paper.quote if row.paper else None,
        "paper_where": row.paper.where if row.paper else None,
        "ratio_ours_over_paper": row.ratio,
        "provenance": row.provenance,
        "note": row.note,
        "formula": row.formula,
        "sources": [asdict(s) for s in row.sources],
    }


def markdown(rows: Sequence[Row]) -> str:
    lines = [
        "| metric | ours | paper | ours / paper | where (paper) | how we got it |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        paper = row.paper.describe() if row.paper else "none given"
        ratio = "n/a" if row.ratio is None else f"{row.ratio:.2f}" if row.ratio >= 0.1 else f"{row.ratio:.2g}"
        how = row.provenance + (f"; {row.note}" if row.note else "")
        where = row.paper.where if row.paper else ""
        lines.append(f"| {row.metric} | {fmt(row.ours, row.unit)} | {paper} | {ratio} | {where} | {how} |")
    return "\n".join(lines) + "\n"


def write_table(out: Path, figure: str, title: str, rows: Sequence[Row], notes: Sequence[str] = ()) -> None:
    """out/table.md and out/table.json."""
    out.mkdir(parents=True, exist_ok=True)
    text = f"# Figure {figure}: {title}\n\n" + markdown(rows)
    if notes:
        text += "\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    (out / "table.md").write_text(text)
    write_json(
        out / "table.json",
        {"figure": figure, "title": title, "rows": [as_dict(r) for r in rows], "notes": list(notes)},
    )
