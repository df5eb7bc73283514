"""`streambox burst`: a small burst of a tiny workflow on a real API proxy through the real gateway,
the params overrides and default inputs, and the errors for a bad workflow."""

from __future__ import annotations

import json
import textwrap

import pytest

from streambox.cli import main
from streambox.phases import PHASES
from streambox.workflows.burst import Memory, burst, default_events, parse_params, resolve_params
from streambox.workflows.examples import load_example

HANDLERS = textwrap.dedent(
    """
    import torch
    import streambox

    @streambox.function
    def make(ctx, event):
        n = int(event.get("params", {}).get("n", 6))
        h = ctx.upload(torch.arange(n, dtype=torch.float32) * event.get("scale", 1))
        ctx.put(ctx.key("x"), h, consumers=2)
        return {"items": [{"key": ctx.key("x")}, {"key": ctx.key("x")}]}

    @streambox.function
    def total(ctx, event):
        return {"sum": float(ctx.download(ctx.get(event["key"])).sum())}
    """
)

WORKFLOW = textwrap.dedent(
    """
    name: tiny
    slo_ms: 1000
    functions:
      make: {handler: "burst_test_handlers:make", params: {n: 6}}
      total: {handler: "burst_test_handlers:total", max_instances: 2}
    edges:
      - {from: make, to: total, select: items, fan_out: true}
    """
)


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    (tmp_path / "burst_test_handlers.py").write_text(HANDLERS)
    path = tmp_path / "tiny.yaml"
    path.write_text(WORKFLOW)
    monkeypatch.setenv("STREAMBOX_STATE_DIR", str(tmp_path / "state"))
    return path


def test_cli_burst_through_the_gateway_reports_latency_cold_starts_and_memory(tiny, tmp_path, capsys):
    event = tmp_path / "event.json"
    event.write_text(json.dumps({"scale": 2}))
    out = tmp_path / "report.json"
    argv = ["burst", str(tiny), "--requests", "3", "--concurrency", "2", "--input", str(event)]
    assert main([*argv, "--params", "n=4", "--pa", "off", "--bt", "off", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "requests ok / failed" in printed and "3 / 0" in printed and "pool reserved" in printed
    batching_row = next(line for line in printed.splitlines() if "batched inferences / calls in them" in line)
    assert "0 / 0" in batching_row  # nothing here batches

    report = json.loads(out.read_text())
    assert report["via"] == "gateway" and report["requests"] == 3 and report["ok"] == 3
    assert report["failed"] == 0 and report["errors"] == {}
    assert report["params"] == {"make": {"n": 4}}
    assert report["proxy_starts"] == 1
    assert report["instance_starts"] >= 2  # at least one instance of each function
    assert report["functions"]["make"]["invocations"] == 3
    assert report["functions"]["total"]["invocations"] == 6  # the fan-out: two per request
    assert len(report["latencies_ms"]) == 3 and report["latency_ms"]["p50"] > 0
    # Where the time went: the mean of each phase, and the client's share (HTTP, the gateway).
    assert "where a request's time goes" in printed
    phases = report["phases_ms"]
    assert list(phases) == [*PHASES, "client"] and phases["cold_start"] > 0  # instances were started
    assert sum(phases.values()) == pytest.approx(report["latency_ms"]["mean"], abs=0.05)
    memory = report["memory"]
    assert memory["device_total_bytes"] > memory["device_used_bytes"] > 0
    assert memory["pool_reserved_bytes"] >= memory["pool_used_bytes"] >= 0  # the pool may be idle by now
    assert report["peak_memory"]["device_used_bytes"] >= memory["device_used_bytes"]
    # The proxy's resolved tree: the switches given, the rest resolved, the device timed (burst's).
    settings = report["settings"]
    assert (settings["pa"], settings["bt"], settings["am"]) == (False, False, True)
    assert settings["pool_mode"] == "fm+rs" and settings["io_label"] == "RZ+PB"
    assert settings["inputs"] == "small" and settings["device"]["device_mode"] == "timed"
    # Where the proxy ran and its store, as its stats said (one GPU: no neighbour, nothing moved).
    assert report["gpu"] == 0 and report["store"]["gpus"] == [0] and report["store"]["moved_to"] == {}
    assert "store (GPU 0)" in printed


def test_burst_straight_to_the_engine_with_stream_sync_completion(tiny):
    report = burst(
        tiny, requests=2, concurrency=2, warmup=1, via="engine", proxy_options={"completion": "sync"}
    )
    assert report.ok == 2 and report.warmup == 1 and report.proxy_options == {"completion": "sync"}
    assert report.memory.device_used_bytes > 0
    assert all(o.body["output"] == [{"sum": 15.0}, {"sum": 15.0}] for o in report.outcomes)


def test_bad_workflows_give_one_line_errors(tmp_path, capsys):
    assert main(["burst", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: no such file" in capsys.readouterr().err

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nfunctions:\n  f: {handler: 'x:y', max_instances: 0}\n")
    assert main(["burst", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "max_instances" in err

    assert main(["burst", "traffic", "--params", "nosuch.image_size=64"]) == 2
    assert "has no function 'nosuch'" in capsys.readouterr().err
    assert main(["burst", "traffic", "--params", "image_size"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err
    assert main(["burst", "traffic", "--params", "detect.=1"]) == 2
    assert "the KEY after 'detect.' is empty" in capsys.readouterr().err
    assert main(["burst", "traffic", "--params", "image_size=NaN"]) == 2  # checked as the YAML's params
    assert "'detect': params.image_size.float: Input should be a finite number" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="2"):  # argparse's usage error, before any deploy
        main(["burst", "traffic", "--system", "nope"])
    assert (
        "--system: invalid choice: 'nope' (choose from 'streambox', 'stream-only')" in capsys.readouterr().err
    )
    assert main(["burst", "traffic", "--params", "detect.image_size=abc"]) == 2
    assert "detect.image_size is a number in the workflow (64); got text 'abc'" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("")  # a --json path that cannot be written: refused before the run
    assert main(["burst", "traffic", "--json", str(tmp_path / "a-file" / "report.json")]) == 2
    err = capsys.readouterr().err
    assert "streambox burst: error:" in err and "a-file" in err and "device mode" not in err
    with pytest.raises(SystemExit, match="2"):  # argparse's usage error
        main(["invoke", "traffic", "--timeout", "inf"])
    assert "must be a finite number of seconds > 0, got inf" in capsys.readouterr().err


def test_traffic_params_and_default_inputs():
    spec = load_example("traffic")
    small = resolve_params(spec)  # the zoo's small shapes, as `serve --inputs small` and replay's
    assert small.functions["detect"].params == load_example("traffic", small=True).functions["detect"].params
    assert small.functions["detect"].params["image_size"] == 64
    assert resolve_params(spec, inputs="full").functions["detect"].params["image_size"] == 320
    with pytest.raises(ValueError, match="inputs 'tiny' is not one of small, full"):
        resolve_params(spec, inputs="tiny")
    tuned = resolve_params(spec, ["image_size=96", "detect.min_box=1.5", "face.flag=true"])
    assert tuned.functions["detect"].params["image_size"] == 96
    assert tuned.functions["detect"].params["min_box"] == 1.5
    assert tuned.functions["face"].params == {"flag": True}
    # a key no function declares goes to the entry functions
    assert parse_params(["brand_new=x"], spec) == {"detect": {"brand_new": "x"}}
    # a value of another kind than the workflow's is named before any request runs
    with pytest.raises(
        ValueError, match=r"detect.image_size is a number in the workflow \(320\); got text 'abc'"
    ):
        parse_params(["detect.image_size=abc"], spec)
    assert parse_params(["detect.min_box=2"], spec) == {"detect": {"min_box": 2}}  # an int for a float

    events = default_events(spec, 3)
    assert len(events) == 3 and all("image" in e for e in events)
    assert events[0] != events[1] and events[0] == default_events(spec, 1)[0]  # seeded per request
    social = default_events(load_example("social-media"), 1)[0]
    assert {"post_id", "text", "image"} <= set(social)


def test_memory_from_the_gateway_metrics_text():
    text = textwrap.dedent(
        """
        streambox_device_memory_used_bytes{device="0"} 1000
        streambox_device_memory_total_bytes{device="0"} 5000
        streambox_pool_reserved_bytes{workflow="tiny",device="0"} 300
        streambox_pool_used_bytes{workflow="tiny",device="0"} 200
        streambox_pool_reserved_bytes{workflow="other",device="0"} 999
        streambox_function_instances{workflow="tiny",function="make"} 2
        # TYPE streambox_batches counter
        streambox_batches_total{workflow="tiny"} 3
        streambox_batches_total{workflow="other"} 9
        # TYPE streambox_batched_calls counter
        streambox_batched_calls_total{workflow="tiny"} 7
        """
    )
    memory = Memory.from_metrics(text, "tiny")
    assert (memory.device_used_bytes, memory.device_total_bytes) == (1000, 5000)
    assert (memory.pool_reserved_bytes, memory.pool_used_bytes) == (300, 200)
    assert memory.instances == {"make": 2}
    assert (memory.batches, memory.batched_calls) == (3, 7)
    # A burst reports its own batches, not the warm-up's (nor those of a proxy that restarted since).
    from streambox.workflows.burst import _batching_since

    earlier = Memory(batches=1, batched_calls=2)
    since = _batching_since(memory, earlier)
    assert (since.batches, since.batched_calls) == (2, 5)
    restarted = Memory(batches=9, batched_calls=20)
    assert _batching_since(memory, restarted) == memory


def test_a_stream_only_burst_passes_data_through_the_ipc_store(tiny):
    """Stream-only's data path is CUDA-IPC style: each fan-out GET opens the PUT's exported handle."""
    report = burst(tiny, requests=2, concurrency=1, via="engine", system="stream-only")
    assert report.ok == 2 and report.settings["comm_store"] == "ipc"
    assert all(o.body["output"] == [{"sum": 15.0}, {"sum": 15.0}] for o in report.outcomes)
    store = report.store
    assert store["kind"] == "ipc" and store["puts"] == 2 and store["gets"]["ipc-handle"] == 4
    assert store["device_allocs"] == 2 and store["modelled_host_s"]["open"] > 0
