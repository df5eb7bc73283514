"""The API proxy: function cold start, forwarded no-op round trip per channel, completion by event
polling vs stream sync. Emulated device; real processes throughout.

1. Cold start of a function on a warm proxy (its runtime and model already resident): the client's
   wall time for the first request of a new instance (pre-forked spare, and fork on demand), and
   the proxy's own figure for the instance start (fork or spare + stream + registration). Baseline:
   a process per function that imports the framework, creates its own runtime and loads its model
   (resnet18) itself. The emulated context creation is a modelled sleep (`context_create_s`): it is
   reported apart and left out of the baseline's real cost.
2. A forwarded no-op call (function process -> proxy dispatcher -> back), timed in the function,
   per channel; plus the bare channels (an echo loop, no dispatcher) for reference, with and
   without spinning.
3. `ctx.infer` + `ctx.download` of resnet18 timed in the function, with the proxy completing the
   download by polling an event recorded after it (sync-lite) or by a blocking stream sync on a
   helper thread; one instance, then four at once.

`--quick` runs fewer samples (about a minute and a half on 2 cores).
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import parser, print_table, write_json  # noqa: E402

from streambox.api_proxy import wire  # noqa: E402
from streambox.api_proxy.channel import connect, make_server  # noqa: E402
from streambox.api_proxy.control import ProxyClient, ProxyProcess, launch_proxy  # noqa: E402
from streambox.api_proxy.proxy_config import ProxyConfig, ProxyFunction  # noqa: E402
from streambox.api_proxy.shm_ring import private_dir  # noqa: E402
from streambox.config import Config  # noqa: E402

MODEL = "resnet18"
ROUNDS = 3  # completion modes are measured in alternating rounds


def _launch(config: ProxyConfig) -> ProxyProcess:
    started = time.perf_counter()
    proxy = launch_proxy(config)
    print(f"proxy {config.workflow} warm in {time.perf_counter() - started:.1f} s", flush=True)
    return proxy


HANDLERS = textwrap.dedent(
    """
    import time
    import torch
    import streambox

    def _percentiles(samples):
        s = sorted(samples)
        pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]
        return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "n": len(s)}

    @streambox.function(models=["resnet18"])
    def cold(ctx, event):
        return {"ok": True}

    @streambox.function
    def pingpong(ctx, event):
        for _ in range(event["warmup"]):
            ctx.noop()
        samples = []
        for _ in range(event["n"]):
            t = time.perf_counter()
            ctx.noop()
            samples.append(time.perf_counter() - t)
        return _percentiles(samples)

    @streambox.function(models=["resnet18"])
    def infer_loop(ctx, event):
        x = ctx.upload(torch.randn(1, 3, 32, 32))
        samples = []
        for i in range(event["warmup"] + event["n"]):
            t = time.perf_counter()
            (logits,) = ctx.infer("resnet18", x)
            ctx.download(logits)
            ctx.free(logits)
            if i >= event["warmup"]:
                samples.append(time.perf_counter() - t)
        return {"samples": samples}
    """
)

BASELINE = textwrap.dedent(
    """
    import json, sys, time
    import torch
    import streambox
    from streambox.api_proxy.executor import StreamPoolAllocator, upload_model
    from streambox.config import Config
    from streambox.kernel_compiler.model_pool import ModelPool
    from streambox.kernel_compiler.zoo import get_entry
    imported = time.perf_counter()
    config = Config.from_env()
    backend = config.open_backend()
    runtime = backend.open_runtime(0)
    opened = time.perf_counter()
    plan = ModelPool(config.model_pool).get_or_lower("resnet18", 1, get_entry("resnet18").small_input_shape)
    stream = runtime.create_stream()
    model = upload_model(runtime, plan, StreamPoolAllocator(runtime), stream)
    stream.synchronize()
    ready = time.perf_counter()
    print(json.dumps({"imported": imported, "opened": opened, "ready": ready,
                      "modelled_context_s": backend.spec.context_create_s}), flush=True)
    runtime.close()
    """
)


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def ms(x: float) -> str:
    return f"{x * 1e3:,.2f}"


def us(x: float) -> str:
    return f"{x * 1e6:,.1f}"


# -- 1. cold start --------------------------------------------------------------------------------


def streambox_cold_starts(proxy: ProxyProcess, count: int) -> dict[str, Any]:
    """Cold requests of `cold` on a warm proxy: each instance expires (keep-alive 50 ms) and the
    template refills its spare before the next request."""
    client = proxy.client
    client.invoke("cold", {}, request_id="warmup")
    e2e, start = [], []
    warm = []
    for i in range(count):
        time.sleep(0.25)  # the last instance stops (scale to zero); a new spare is forked meanwhile
        t = time.perf_counter()
        reply = client.invoke("cold", {}, request_id=f"c{i}")
        e2e.append(time.perf_counter() - t)
        if not reply["cold_start"]:
            raise RuntimeError("expected a cold start: the previous instance did not expire")
        start.append(reply["start_s"])
        t = time.perf_counter()
        again = client.invoke("cold", {}, request_id=f"w{i}")
        warm.append(time.perf_counter() - t)
        assert not again["cold_start"]
    return {"e2e_s": e2e, "instance_start_s": start, "warm_e2e_s": warm}


def baseline_cold_starts(count: int, env: dict[str, str]) -> dict[str, Any]:
    """A process per function: import the framework, create a runtime, load the model."""
    runs = []
    for _ in range(count):
        t = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-c", BASELINE],
            env=env,
            cwd=tempfile.gettempdir(),
            capture_output=True,
            text=True,
        )
        if out.returncode != 0:
            raise RuntimeError(f"baseline process failed:\n{out.stderr[-2000:]}")
        marks = json.loads(out.stdout.strip().splitlines()[-1])
        total = marks["ready"] - t
        modelled = marks["modelled_context_s"]
        runs.append(
            {
                "total_s": total,
                "modelled_context_s": modelled,
                "real_s": total - modelled,
                "import_s": marks["imported"] - t,
                "runtime_real_s": marks["opened"] - marks["imported"] - modelled,
                "model_load_s": marks["ready"] - marks["opened"],
            }
        )
    return {"runs": runs}


# -- 2. no-op round trips ---------------------------------------------------------------------------


def raw_channel_echo(kind: str, count: int, spin_s: float) -> list[float]:
    """The bare channel: a forked client and an echo loop here (no dispatcher, no proxy)."""
    import zmq

    directory = private_dir("sbx-bench-")
    server = make_server(kind, directory, capacity=1 << 20, spin_s=spin_s)
    endpoint = server.add(1)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the client
        try:
            os.close(read_fd)
            channel = connect(endpoint)
            message = wire.pack([wire.CALL, 1, "noop", []])
            samples = []
            for i in range(count + 200):
                t = time.perf_counter()
                channel.send(message)
                channel.recv()
                if i >= 200:
                    samples.append(time.perf_counter() - t)
            channel.send(b"stop")
            os.write(write_fd, json.dumps(samples).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    poller = zmq.Poller()
    for item in server.poll_items():
        poller.register(item, zmq.POLLIN)
    reply = wire.pack([wire.REPLY, 1, True, None])
    stop = False

    def deliver(instance_id: int, data: bytes) -> None:
        nonlocal stop
        if data == b"stop":
            stop = True
            return
        wire.unpack(data)
        server.send(instance_id, reply)

    last = time.perf_counter()
    while not stop:
        if server.poll(deliver):
            last = time.perf_counter()
            continue
        if time.perf_counter() - last < spin_s:
            os.sched_yield()
            continue
        if server.prepare_sleep():
            poller.poll(50)
            server.after_sleep()
    chunks = []
    while chunk := os.read(read_fd, 1 << 20):
        chunks.append(chunk)
    os.close(read_fd)
    os.waitpid(pid, 0)
    server.close()
    shutil.rmtree(directory, ignore_errors=True)
    return json.loads(b"".join(chunks))


def forwarded_noop(proxy: ProxyProcess, count: int) -> dict[str, float]:
    return proxy.client.invoke("pingpong", {"n": count, "warmup": 500}, request_id="noop")["output"]


# -- 3. completion ------------------------------------------------------------------------------------


def infer_completion(proxy: ProxyProcess, count: int, concurrency: int) -> list[float]:
    clients = [proxy.client] + [ProxyClient(proxy.address) for _ in range(concurrency - 1)]
    event = {"n": count, "warmup": 3}
    try:
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            replies = list(pool.map(lambda c: c.invoke("infer_loop", event, request_id="inf"), clients))
    finally:
        for c in clients[1:]:
            c.close()
    return [s for r in replies for s in r["output"]["samples"]]


# -- main -----------------------------------------------------------------------------------------------


def main() -> int:
    args = parser(__doc__.splitlines()[0]).parse_args()
    quick = args.quick
    n_cold, n_base = (15, 3) if quick else (60, 5)
    n_noop = 3000 if quick else 20000
    n_infer = 30 if quick else 150
    work = Path(tempfile.mkdtemp(prefix="sbx-bench-proxy-"))
    (work / "bench_proxy_handlers.py").write_text(HANDLERS)
    state = work / "state"
    env = {**os.environ, "STREAMBOX_STATE_DIR": str(state)}
    config = Config.from_env()
    functions = (
        ProxyFunction("cold", "bench_proxy_handlers:cold", models=(MODEL,)),
        ProxyFunction("pingpong", "bench_proxy_handlers:pingpong"),
        ProxyFunction("infer_loop", "bench_proxy_handlers:infer_loop", models=(MODEL,), max_instances=4),
    )
    common = {"functions": functions, "sys_path": (str(work),), "state_dir": str(state), "keep_alive_s": 0.05}
    configs = {
        "shm": ProxyConfig(workflow="bench-shm", channel="shm", completion="poll", prefork=2, **common),
        "fork": ProxyConfig(workflow="bench-fork", channel="shm", completion="poll", prefork=0, **common),
        "zmq": ProxyConfig(workflow="bench-zmq", channel="zmq", completion="poll", prefork=2, **common),
        "sync": ProxyConfig(workflow="bench-sync", channel="shm", completion="sync", prefork=2, **common),
    }
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} cores, load average {load[0]:.2f}; emulated {config.device_preset}")
    results: dict[str, Any] = {"load_average": load}
    # One proxy at a time (but the two completion modes, compared in alternating rounds): an idle
    # proxy's periodic threads (pool scaler and sweep, store ticker) take a few per cent of a core.
    try:
        raw = {
            "shm (spin)": raw_channel_echo("shm", n_noop, 200e-6),
            "shm (no spin: doorbell only)": raw_channel_echo("shm", n_noop // 3, 0.0),
            "zmq ipc": raw_channel_echo("zmq", n_noop, 200e-6),
        }
        forwarded, cold, completion = {}, {}, {}
        for key in ("zmq", "fork"):
            proxy = _launch(configs[key])
            try:
                if key == "zmq":
                    forwarded[key] = forwarded_noop(proxy, n_noop)
                else:
                    cold[key] = streambox_cold_starts(proxy, n_cold)
            finally:
                proxy.stop()
        shm = _launch(configs["shm"])
        try:
            forwarded["shm"] = forwarded_noop(shm, n_noop)
            cold["shm"] = streambox_cold_starts(shm, n_cold)
            sync = _launch(configs["sync"])
            try:  # alternating rounds, so that load drifting over time hits both modes alike
                for c in (1, 4):
                    for _ in range(ROUNDS):
                        for mode, proxy in (("event polling", shm), ("stream sync", sync)):
                            samples = infer_completion(proxy, n_infer // ROUNDS, c)
                            completion.setdefault((mode, c), []).extend(samples)
            finally:
                sync.stop()
        finally:
            shm.stop()
        baseline = baseline_cold_starts(n_base, env)
        results["noop"] = {
            "forwarded": forwarded,
            "raw": {
                k: {"p50": pct(v, 0.5), "p90": pct(v, 0.9), "p99": pct(v, 0.99), "n": len(v)}
                for k, v in raw.items()
            },
        }
        results["cold_start"] = {"streambox": cold, "baseline": baseline}
        results["completion"] = {f"{m} x{c}": v for (m, c), v in completion.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    # -- tables ---------------------------------------------------------------------------------------
    runs = baseline["runs"]
    base_real = statistics.median(r["real_s"] for r in runs)
    base_total = statistics.median(r["total_s"] for r in runs)
    modelled = runs[0]["modelled_context_s"]
    rows = []
    for label, key, series in (
        ("StreamBox: cold request, pre-forked spare (client wall)", "shm", "e2e_s"),
        ("  of which instance start (spare + stream + registration)", "shm", "instance_start_s"),
        ("StreamBox: cold request, fork on demand (client wall)", "fork", "e2e_s"),
        ("  of which instance start (fork + stream + registration)", "fork", "instance_start_s"),
        ("StreamBox: warm request right after (overlaps the spare refill)", "shm", "warm_e2e_s"),
    ):
        s = cold[key][series]
        rows.append(
            [
                label,
                ms(pct(s, 0.5)),
                ms(pct(s, 0.9)),
                len(s),
                f"{base_real / pct(s, 0.5):,.0f}x",
                "p50 <= 5 ms, >= 100x" if series == "e2e_s" and key == "shm" else "",
            ]
        )
    rows.append(
        [
            "process per function, real cost (import + runtime + model)",
            ms(base_real),
            ms(max(r["real_s"] for r in runs)),
            len(runs),
            "1x (baseline)",
            "",
        ]
    )
    for part in ("import_s", "runtime_real_s", "model_load_s"):
        rows.append(
            [
                f"  of which {part.removesuffix('_s').replace('_', ' ')}",
                ms(statistics.median(r[part] for r in runs)),
                "",
                "",
                "",
                "",
            ]
        )
    rows.append(
        [
            "  modelled context creation (emulated; not in the ratio)",
            ms(modelled),
            "",
            "",
            "",
            f"total with it: {ms(base_total)} ms",
        ]
    )
    print_table(
        "1. Function cold start on a warm proxy vs a process per function (ms)",
        ["", "p50", "p90 (base: max)", "n", "speed-up vs baseline", "target"],
        rows,
    )

    zmq_p50 = forwarded["zmq"]["p50"]
    rows = []
    for name, label in (
        ("shm", "forwarded no-op, shm ring (default)"),
        ("zmq", "forwarded no-op, pyzmq ipc"),
    ):
        f = forwarded[name]
        rows.append(
            [
                label,
                us(f["p50"]),
                us(f["p90"]),
                us(f["p99"]),
                f["n"],
                f"{zmq_p50 / f['p50']:.1f}x",
                "p50 <= 20 us" if name == "shm" else "",
            ]
        )
    for name, r in results["noop"]["raw"].items():
        rows.append(
            [
                f"bare channel echo, {name}",
                us(r["p50"]),
                us(r["p90"]),
                us(r["p99"]),
                r["n"],
                f"{zmq_p50 / r['p50']:.1f}x",
                "",
            ]
        )
    print_table(
        "2. No-op round trip, function process -> proxy -> back (us); ratio = pyzmq forwarded / row",
        ["", "p50", "p90", "p99", "n", "vs zmq forwarded", "target"],
        rows,
    )

    rows = []
    for c in (1, 4):
        poll, sync = completion[("event polling", c)], completion[("stream sync", c)]
        for mode, s in (("event polling (sync-lite)", poll), ("stream sync (helper thread)", sync)):
            rows.append(
                [
                    f"{mode}, {c} instance(s)",
                    ms(pct(s, 0.5)),
                    ms(pct(s, 0.9)),
                    len(s),
                    f"{pct(sync, 0.5) / pct(s, 0.5):.2f}x",
                ]
            )
    print_table(
        f"3. {MODEL} infer + download, completion by event polling vs stream sync (ms); "
        "ratio = stream sync p50 / row p50",
        ["", "p50", "p90", "n", "ratio"],
        rows,
    )
    print(
        f"machine: {os.cpu_count()} cores, load average before {load[0]:.2f}, after {os.getloadavg()[0]:.2f}"
    )

    write_json(
        args.json, "bench_proxy", {"quick": quick, "model": MODEL, "preset": config.device_preset}, results
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
