"""`streambox paper`: every figure's table is what this run measured, beside the paper's numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from streambox.cli import main
from streambox.replay.paper.cli import ALL_FIGURES
from streambox.replay.paper.figures import FIGURES, MISSING
from streambox.replay.paper.numbers import PAPER
from streambox.replay.paper.table import Row, Source, check_rows, row_from, write_table


def test_every_paper_number_is_quoted_with_its_place() -> None:
    for key, number in PAPER.items():
        assert key.split(".")[0] in ALL_FIGURES, key
        assert number.quote and "Fig." in number.where and "sec. 9" in number.where, key
        assert number.factor > 0, key


def test_every_figure_has_a_builder_or_says_why_not() -> None:
    assert set(FIGURES) | set(MISSING) == set(ALL_FIGURES)
    assert not set(FIGURES) & set(MISSING)


def test_a_table_number_that_is_not_in_its_source_is_caught(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text(json.dumps({"a": {"b": 3.0}, "c": 12.0}))
    (tmp_path / "run" / "requests.csv").write_text("status,pattern\nok,bursty\nok,sporadic\nerror,bursty\n")
    rows = [
        row_from(
            tmp_path,
            "a over c",
            "x",
            [Source("run/summary.json", "a.b"), Source("run/summary.json", "c")],
            "ratio",
            paper_key="13.throughput.stream-only",
        ),
        row_from(
            tmp_path, "ok bursty", "requests", [Source("run/requests.csv", "count:status=ok,pattern=bursty")]
        ),
    ]
    assert rows[0].ours == 0.25 and rows[1].ours == 1.0
    assert rows[0].ratio == pytest.approx(0.25 / 1.46)
    write_table(tmp_path / "fig", "13", "t", rows)
    written = json.loads((tmp_path / "fig" / "table.json").read_text())["rows"]
    assert check_rows(tmp_path, written) == []
    written[0]["ours"] = 0.3  # a number typed in rather than measured
    assert check_rows(tmp_path, written) == ["a over c: table says 0.3, sources say 0.25"]
    with pytest.raises(KeyError, match="no paper number"):
        Row("m", 1.0, "x", [], paper_key="13.no-such")


def test_a_median_over_repeats_is_the_median_of_each_runs_ratio(tmp_path: Path) -> None:
    sources = []
    for i, (ours, base) in enumerate([(1.0, 2.0), (3.0, 1.0), (1.0, 1.0)]):  # ratios 0.5, 3, 1
        (tmp_path / f"r{i}").mkdir()
        (tmp_path / f"r{i}" / "ours.json").write_text(json.dumps({"p50": ours}))
        (tmp_path / f"r{i}" / "base.json").write_text(json.dumps({"p50": base}))
        sources += [Source(f"r{i}/ours.json", "p50"), Source(f"r{i}/base.json", "p50")]
    row = row_from(tmp_path, "p50, median of 3 runs", "x", sources, "median_ratio")
    assert row.ours == 1.0  # not the ratio of medians (1.0 / 1.0 here too) but of each run: 0.5, 1, 3
    assert row_from(tmp_path, "two", "x", sources[:4], "median_ratio").ours == pytest.approx(1.75)
    with pytest.raises(ValueError, match="pairs"):
        row_from(tmp_path, "odd", "x", sources[:3], "median_ratio")


def test_an_unknown_figure_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["paper", "11"]) == 2
    assert "figure '11' is not one of 12" in capsys.readouterr().err


def _check_figures(out: Path, figures: list[str]) -> None:
    for figure in figures:
        folder = out / f"fig{figure}"
        table = json.loads((folder / "table.json").read_text())
        assert table["figure"] == figure and table["rows"], figure
        assert (folder / "table.md").read_text().startswith(f"# Figure {figure}")
        assert list(folder.glob("*.png")), f"figure {figure} wrote no plot"
        # every number was read from a file this run wrote under `out` (a fresh folder)
        assert check_rows(out, table["rows"]) == [], figure
        compared = [r for r in table["rows"] if r["paper"] is not None]
        assert compared, f"figure {figure} sets no number beside the paper's"
        for row in compared:
            if row["ours"] is not None:
                assert row["ratio_ours_over_paper"] == pytest.approx(row["ours"] / row["paper"])


@pytest.mark.slow
@pytest.mark.timeout(900)  # two comparisons of two replays (figure 12's at batch 16) and a benchmark
def test_the_replay_figures_quick_share_one_comparison(tmp_path: Path) -> None:
    out = tmp_path / "paper"
    figures = ["12", "13", "14", "15"]
    assert (
        main(
            [
                "paper",
                *figures,
                "--quick",
                "--no-progress",
                "--out",
                str(out),
                "--systems",
                "streambox,stream-only",
            ]
        )
        == 0
    )
    assert sorted(p.name for p in (out / "replay").iterdir()) == ["report", "stream-only", "streambox"]
    _check_figures(out, figures)
    # Fig. 12 (right): memory per workflow, each system's and StreamBox / the baseline
    metrics = {r["metric"]: r["ours"] for r in json.loads((out / "fig12" / "table.json").read_text())["rows"]}
    assert metrics["mean memory, traffic, streambox"] > 0
    assert metrics["mean memory, traffic, streambox / stream-only"] > 0
    assert (out / "fig12" / "mean_memory_per_workflow.png").exists()
    # Fig. 12 at the paper's batch size: a comparison of its own, StreamBox against stream-only
    assert sorted(p.name for p in (out / "replay-b16").iterdir()) == ["report", "stream-only", "streambox"]
    assert metrics["mean memory at batch 16, streambox / stream-only"] > 0
    assert (out / "fig12" / "memory_over_time_b16.png").exists()
    # --reuse rebuilds the tables from the same measurements: no replay or benchmark runs again
    measured = {
        p: p.stat().st_mtime_ns for p in [*out.glob("replay*/*/summary.json"), *out.glob("bench/*.json")]
    }
    (out / "fig13" / "table.json").unlink()
    assert (
        main(
            ["paper", *figures, "--quick", "--reuse", "--out", str(out), "--systems", "streambox,stream-only"]
        )
        == 0
    )
    assert {p: p.stat().st_mtime_ns for p in measured} == measured
    _check_figures(out, figures)


@pytest.mark.slow
@pytest.mark.timeout(900)  # two replay comparisons of two systems, three requests each
def test_repeats_add_each_factors_median_over_the_runs(tmp_path: Path) -> None:
    out = tmp_path / "paper"
    args = ["paper", "14", "--quick", "--no-progress", "--out", str(out)]
    args += ["--systems", "streambox,stream-only"]
    assert main([*args, "--repeats", "2"]) == 0
    assert (out / "replay-2" / "streambox" / "summary.json").exists()
    _check_figures(out, ["14"])
    rows = {r["metric"]: r for r in json.loads((out / "fig14" / "table.json").read_text())["rows"]}
    median = rows["p50 latency, streambox / stream-only, median of 2 runs"]
    assert median["formula"] == "median_ratio" and len(median["sources"]) == 4
    assert median["note"].startswith("each run: ") and median["paper"] is not None
    assert main([*args, "--repeats", "0"]) == 2


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("figure", [f for f in FIGURES if f not in {"12", "13", "14", "15", "19"}])
def test_a_benchmark_figure_quick_writes_its_plots_and_a_measured_table(tmp_path: Path, figure: str) -> None:
    out = tmp_path / "paper"
    assert main(["paper", figure, "--quick", "--out", str(out)]) == 0
    assert not (out / "replay").exists()  # a benchmark figure runs no replay
    _check_figures(out, [figure])
    named = {"16": "bench_comm", "17": "bench_io_daemon"}.get(figure)
    if named is not None:  # the note names the command as it ran (--quick and the CI-sized cuts)
        args = json.loads((out / "bench" / f"{named}.args.json").read_text())["args"]
        assert " ".join([f"benchmarks/{named}.py", *args]) in (out / f"fig{figure}" / "table.md").read_text()
    if figure == "16":  # stream-only's own data path (the CUDA-IPC store) beside StreamBox's store
        rows = json.loads((out / "fig16" / "table.json").read_text())["rows"]
        against = [r for r in rows if "stream-only's CUDA-IPC store" in r["metric"]]
        assert against and all(r["ours"] and r["provenance"].startswith("partly modelled") for r in against)
        assert any(r["paper_quote"] == "and by 73% compared to Stream-only" for r in against)


@pytest.mark.slow
@pytest.mark.timeout(900)  # two tenant counts, two systems: four replays
def test_the_users_figure_quick_replays_each_tenant_count(tmp_path: Path) -> None:
    out = tmp_path / "paper"
    args = ["paper", "19", "--quick", "--no-progress", "--out", str(out)]
    args += ["--systems", "streambox,stream-only"]
    assert main(args) == 0
    assert sorted(p.name for p in out.iterdir()) == ["fig19", "tenants2", "tenants3"]
    config = json.loads((out / "tenants3" / "streambox" / "config.json").read_text())["config"]
    assert config["workflows"] == ["traffic@1", "traffic@2", "traffic@3"]
    _check_figures(out, ["19"])
    measured = {p: p.stat().st_mtime_ns for p in out.glob("tenants*/*/summary.json")}
    assert main([*args, "--reuse"]) == 0  # the table again from the same runs, none replayed
    assert {p: p.stat().st_mtime_ns for p in measured} == measured


def test_a_figure_that_cannot_be_built_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if not MISSING:
        pytest.skip("every figure has a builder")
    assert main(["paper", *MISSING, "--out", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    for figure, why in MISSING.items():
        assert f"figure {figure}: NOT BUILT: {why}" in err


def test_reuse_takes_only_runs_that_measured_what_the_figure_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--reuse compares a stored run's whole configuration and label with the run it stands for: another
    system, option, time scale or an ablation set in the environment is measured again, never reused."""
    from streambox.replay.paper.session import QUICK, Session
    from streambox.replay.run import replay_config, run_label
    from streambox.replay.target import SystemRequest, resolve_system

    systems = ("streambox", "stream-only")
    session = Session(tmp_path, quick=True, systems=systems, reuse=True)

    def store(folder: str, **change: object) -> None:
        wanted = replay_config(system=folder, out=tmp_path / "replay" / folder, **QUICK.options())
        config = wanted.model_copy(update=change)
        request = SystemRequest(config.system, tuple(config.workflows), options=dict(config.system_options))
        run = tmp_path / "replay" / folder
        run.mkdir(parents=True, exist_ok=True)
        label = run_label(config, resolve_system(config.system, request).describe())
        stored = {"config": config.model_dump(mode="json"), "label": label}
        (run / "config.json").write_text(json.dumps(stored))
        (run / "summary.json").write_text("{}")

    for system in systems:
        store(system)
    assert session._reused_comparison(tmp_path / "replay", QUICK) is not None
    store("streambox", minute_seconds=0.5)  # another time scale
    assert session._reused_comparison(tmp_path / "replay", QUICK) is None
    assert "minute_seconds" in capsys.readouterr().out
    store("streambox", system="inprocess-cpu", system_options={})  # another system in streambox's folder
    assert session._reused_comparison(tmp_path / "replay", QUICK) is None
    assert "system" in capsys.readouterr().out
    monkeypatch.setenv("STREAMBOX_POOL_MODE", "static")
    store("streambox")  # an ablation made through the environment ...
    monkeypatch.delenv("STREAMBOX_POOL_MODE")
    assert session._reused_comparison(tmp_path / "replay", QUICK) is None  # ... is not StreamBox
    assert "pool_mode=static" in capsys.readouterr().out
    # A damaged run is measured again (it used to stop the call: a JSON error naming no file, or a
    # traceback for a summary that is no object), and the tables say what was reused, and only then.
    for system in systems:
        store(system)
    (tmp_path / "replay" / "stream-only" / "summary.json").write_text("[1, 2]")
    assert session._reused_comparison(tmp_path / "replay", QUICK) is None
    (tmp_path / "replay" / "stream-only" / "summary.json").write_text("{}")
    (tmp_path / "replay" / "stream-only" / "config.json").write_text("{oops")
    assert session._reused_comparison(tmp_path / "replay", QUICK) is None
    assert "stream-only: its summary.json or config.json cannot be read" in capsys.readouterr().out
    fresh = Session(tmp_path, quick=True, systems=systems, reuse=True)
    assert fresh.machine_note().startswith("host: ")  # nothing reused yet
    store("stream-only")
    assert fresh._reused_comparison(tmp_path / "replay", QUICK) is not None
    assert fresh.machine_note().startswith("rebuilt from measurements already in the output folder "
                                             "(--reuse: replay)")
    assert fresh.runs_note() == []
    # An ablation asked for through the environment is what the call measures, and its tables say so
    # (they presented StreamBox with FM and RS off as StreamBox).
    monkeypatch.setenv("STREAMBOX_POOL_MODE", "static")
    for system in systems:
        store(system)
    ablated = Session(tmp_path, quick=True, systems=systems, reuse=True)
    assert ablated._reused_comparison(tmp_path / "replay", QUICK) is not None
    sources = ["replay/streambox/summary.json", "replay/stream-only/requests.csv"]
    notes = ablated.runs_note(sources)
    assert len(notes) == 2 and notes[1].startswith("the rows from replay/streambox are streambox[")
    assert all(note.endswith("pool_mode=static]'s") for note in notes)
    assert ablated.runs_note(["bench/bench_memory_pool.json"]) == []  # a table of a benchmark's rows


def test_systems_a_figure_cannot_use_are_refused_before_anything_is_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "paper"
    assert main(["paper", "12", "--quick", "--out", str(out), "--systems", "stream-only,infless"]) == 3
    assert "figure 12: NOT BUILT: the figure compares streambox with the baselines" in capsys.readouterr().err
    assert not (out / "replay").exists()  # said before replaying anything
    assert main(["paper", "12", "--quick", "--out", str(out), "--systems", "streambox,monolithic"]) == 2
    assert "--systems: monolithic not among Table 2's systems" in capsys.readouterr().err


def test_figure_12_at_batch_16_is_left_out_with_a_reason_and_never_takes_the_figure_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The batch-16 comparison needs StreamBox and stream-only; without one, or when it fails, figure 12
    keeps its measured rows and says why it has none at batch 16 (and no stale plot of it)."""
    from streambox.replay.paper.figures import _batch16_rows
    from streambox.replay.paper.session import Session

    (tmp_path / "fig12").mkdir()
    stale = tmp_path / "fig12" / "memory_over_time_b16.png"
    stale.write_bytes(b"an earlier call's")
    alone = Session(tmp_path, quick=True, systems=("streambox", "infless"))
    rows, note = _batch16_rows(alone)
    assert rows == [] and "--systems lacks one" in note and not stale.exists()
    assert not (tmp_path / "replay-b16").exists()  # nothing was replayed

    both = Session(tmp_path, quick=True, systems=("streambox", "stream-only"))

    def fail() -> None:
        raise RuntimeError("the proxy died")

    monkeypatch.setattr(both, "batch16", fail)
    rows, note = _batch16_rows(both)
    assert rows == [] and note == "no comparison at batch 16: it failed (RuntimeError: the proxy died)"


def test_an_interrupted_comparison_builds_no_figure_and_is_never_reused(tmp_path: Path) -> None:
    """Ctrl-C during a figure's replays: the run keeps what it measured, but no table is built from it
    and --reuse measures again rather than take it as finished."""
    from streambox.replay.paper.session import QUICK, Session

    session = Session(tmp_path, quick=True, systems=("streambox",), reuse=True)
    run = tmp_path / "replay" / "streambox"
    run.mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (run / "summary.json").write_text(json.dumps({"requests": {"stopped_by": "interrupted"}}))
    assert session._reused_comparison(tmp_path / "replay", QUICK) is None


def test_a_benchmark_measured_under_an_environment_switch_is_said_and_not_reused_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`STREAMBOX_IO_DAEMON=off paper 16` built figure 16 with StreamBox's IO daemon off, said nothing,
    and `--reuse` without the variable took it as StreamBox's."""
    from streambox.replay.paper.session import FigureUnavailable, Session

    monkeypatch.setenv("STREAMBOX_IO_DAEMON", "off")
    target = tmp_path / "bench" / "bench_nosuch.json"  # a benchmark that cannot run: reuse or fail
    target.parent.mkdir()
    target.write_text(json.dumps({"results": {}}))
    ran = {"args": ["--quick"], "environment": {"STREAMBOX_IO_DAEMON": "off"}}
    target.with_suffix(".args.json").write_text(json.dumps(ran))
    session = Session(tmp_path, quick=False, systems=("streambox",), reuse=True)
    assert session.benchmark("bench_nosuch") == target  # reused: measured as asked now
    assert session.runs_note(["bench/bench_nosuch.json"]) == [
        "the rows from bench/bench_nosuch.json were measured with STREAMBOX_IO_DAEMON=off"
    ]
    assert session.runs_note(["replay/streambox/summary.json"]) == []
    monkeypatch.delenv("STREAMBOX_IO_DAEMON")
    with pytest.raises(FigureUnavailable, match="bench_nosuch failed"):  # measured again, not reused
        Session(tmp_path, quick=False, systems=("streambox",), reuse=True).benchmark("bench_nosuch")
