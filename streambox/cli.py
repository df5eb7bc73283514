"""The `streambox` command line.

Building the parser imports no torch, torchvision, aiohttp or zmq: each subcommand's arguments come
from the settings tree (`streambox.flags`) and its handler module is imported only when it runs
(`handler` is a "module:function" string). `main` builds only the subcommand named on the command
line, so `streambox --help` and `streambox COMMAND --help` answer quickly.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from streambox.arg_types import http_url, non_negative_int, port, positive_int, positive_seconds, shape
from streambox.config import SYSTEMS, Config, system_default, unknown_environment
from streambox.flags import DEVICE, MECHANISMS, RUN, add_deprecated_alias, add_setting_flags, config_from


def _config(args: argparse.Namespace) -> Config:
    return config_from(args)


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):,.0f} MiB"


def cmd_devices(args: argparse.Namespace) -> int:
    """Each device of the configured backend, like nvidia-smi, counting every process's runtimes."""
    from rich.console import Console
    from rich.table import Table

    backend = _config(args).open_backend()
    table = Table(title=f"StreamBox devices ({backend.name} backend)")
    for column in ("GPU", "Name", "Memory used / total", "Use", "Runtimes", "Streams"):
        table.add_column(column, justify="left" if column == "Name" else "right")
    for usage in backend.device_usage():
        share = usage.used_memory / usage.total_memory if usage.total_memory else 0.0
        table.add_row(
            str(usage.index),
            usage.name,
            f"{_mib(usage.used_memory)} / {_mib(usage.total_memory)}",
            f"{share:.0%}",
            str(usage.runtimes),
            str(usage.streams),
        )
    Console().print(table)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from streambox.demo import run_demo

    return run_demo(_config(args), models=args.models, batch=args.batch)


def cmd_compile(args: argparse.Namespace) -> int:
    """Rewrite a zoo model's kernels into persistent-thread-block form and build them with nvcc."""
    from streambox.kernel_compiler.tvm_compile import CompilerUnavailable, compile_model

    pool_root = args.out if args.out is not None else _config(args).model_pool
    try:
        report = compile_model(
            args.model,
            args.arch,
            pool_root,
            args.batch,
            args.input_shape,
            nvcc=False if args.no_nvcc else None,
        )
    except CompilerUnavailable as error:
        print(f"streambox compile: error: {error}", file=sys.stderr)
        return 2
    print(report.summary())
    return 0


def _gateway_options(args: argparse.Namespace) -> dict[str, int]:
    """The gateway limits given on the command line (the others keep `Gateway`'s defaults)."""
    options = {}
    if args.max_in_flight is not None:
        options["max_in_flight"] = args.max_in_flight
    if args.max_in_flight_mib is not None:
        options["max_body_bytes_in_flight"] = args.max_in_flight_mib << 20
    return options


def _token(path: str | None) -> str | None:
    """The bearer token in `path` (None: no token), or a clear error naming the file."""
    if path is None:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as error:
        raise ValueError(f"--token-file {path}: {error.strerror or error}") from None
    if not token:
        raise ValueError(f"--token-file {path} is empty")
    return token


def cmd_validate(args: argparse.Namespace) -> int:
    """Check workflow YAML files; every mistake is reported with file, line and field."""
    from streambox.workflows.commands import resolve_workflow_path
    from streambox.workflows.validation import validate_file

    invalid = 0
    for path in args.paths:  # every file is checked, whichever fails
        try:
            spec = validate_file(resolve_workflow_path(path))
        except ValueError as error:
            invalid += 1
            print(f"streambox validate: error: {error}", file=sys.stderr)
            continue
        counts = f"{len(spec.functions)} functions, {len(spec.edges)} edges"
        print(f"{path}: workflow {spec.name!r} is valid: {counts}")
    return 2 if invalid else 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve workflows through the HTTP gateway, one API proxy per workflow."""
    from streambox.workflows.commands import inputs_from, proxy_options_from, serve
    from streambox.workflows.gateway import check_bind
    from streambox.workflows.proxy_invoker import ProxyInvoker

    check_bind(args.host, args.allow_remote)  # before the workflows are checked and deployed
    inputs = inputs_from(args)
    config = _config(args)
    options = {"model_shapes": inputs, **proxy_options_from(args)}
    if args.system == "monolithic":
        from streambox.workflows.monolithic import MonolithicInvoker

        proxy_only = sorted(set(options) - {"model_shapes"})
        if proxy_only:
            raise ValueError(f"--system monolithic has no proxy; drop {', '.join(proxy_only)}")
        factory = MonolithicInvoker.factory(model_shapes=inputs)
    else:
        factory = ProxyInvoker.factory(proxy_options=options)
    from streambox.device.modes import describe_device_mode, device_mode_env

    print(describe_device_mode(config.device_mode, config.backend), flush=True)
    with device_mode_env(config.device_mode):  # the proxies and instances it starts follow it
        serve(
            args.paths,
            host=args.host,
            port=args.port,
            system=args.system,
            config=config,
            invoker_factory=factory,
            on_ready=lambda url: print(f"serving on {url} (Ctrl-C stops)", flush=True),
            small=inputs == "small",
            allow_remote=args.allow_remote,
            token=_token(args.token_file),
            gateway_options=_gateway_options(args),
        )
    return 0


def cmd_invoke(args: argparse.Namespace) -> int:
    """One request through a running gateway; prints the JSON response."""
    import json

    from streambox.workflows.commands import GatewayUnreachable, invoke, load_event
    from streambox.workflows.examples import sample_event

    if args.input is not None and args.sample:
        raise ValueError("give at most one of --input FILE or --sample")
    if args.input is None and not args.sample and args.image is None:
        raise ValueError("give --input FILE, --sample or --image FILE")
    event = {}
    if args.input or args.sample:
        event = load_event(args.input) if args.input else sample_event(args.name, args.seed)
    if args.image is not None:  # JPEG/PNG/.npy file bytes as the event's base64 "image"
        from streambox.workflows.image_input import image_field

        try:
            event = {**event, "image": image_field(Path(args.image).read_bytes())}
        except (OSError, ValueError) as error:
            raise ValueError(f"--image {args.image}: {getattr(error, 'strerror', None) or error}") from None
    try:
        token = _token(args.token_file)
        response = invoke(args.name, event, url=args.url, timeout_s=args.timeout, token=token)
    except GatewayUnreachable as error:
        print(f"streambox invoke: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(response.body, indent=1))
    return 0 if response.ok else 1


def _devices_arguments(p: argparse.ArgumentParser) -> None:
    add_setting_flags(p, DEVICE)
    p.set_defaults(handler=cmd_devices)


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    add_setting_flags(p, DEVICE)
    p.add_argument("--models", nargs="*", help="zoo models to run (default: all)")
    p.add_argument("--batch", type=positive_int, default=1, help="batch size (default 1)")
    p.set_defaults(handler=cmd_demo)


def _compile_arguments(p: argparse.ArgumentParser) -> None:
    add_setting_flags(p, DEVICE)
    p.add_argument("model", help="zoo model name")
    p.add_argument("--arch", default="sm_90", help="CUDA architecture, sm_75 to sm_90 (default sm_90)")
    p.add_argument("--out", type=Path, help="model pool directory (default: STREAMBOX_MODEL_POOL)")
    p.add_argument("--batch", type=positive_int, default=1, help="batch size (default 1)")
    p.add_argument("--input-shape", type=shape, help="input shape without the batch, e.g. 3x224x224")
    p.add_argument("--no-nvcc", action="store_true", help="emit CUDA C only")
    p.set_defaults(handler=cmd_compile)


def _validate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", help="workflow YAML files or bundled workflow names")
    p.set_defaults(handler=cmd_validate)


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("paths", nargs="+", help="workflow YAML files or bundled workflow names")
    p.add_argument(
        "--system",
        default=system_default(),
        choices=("streambox", "stream-only", "monolithic"),
        help="streambox (default; STREAMBOX_SYSTEM), stream-only (the proxy with StreamBox's mechanisms off) "
        "or monolithic (the baseline: a process and a runtime per function instance, data through Redis)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=8080)
    p.add_argument(
        "--allow-remote", action="store_true", help="let --host be non-loopback (warns; use a token)"
    )
    p.add_argument("--token-file", help="a file holding the bearer token every caller must send")
    p.add_argument(
        "--max-in-flight",
        type=positive_int,
        help="invocations the gateway admits at once; more get 503 + Retry-After (default 1024)",
    )
    p.add_argument(
        "--max-in-flight-mib",
        type=positive_int,
        help="MiB of request bodies the admitted invocations may hold; more get 503 (default 256)",
    )
    add_setting_flags(p, RUN, MECHANISMS, DEVICE)
    add_deprecated_alias(p, "--small", "inputs", "small")
    p.set_defaults(handler=cmd_serve)


def _invoke_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", help="workflow name")
    p.add_argument("--input", help="JSON file holding the event")
    p.add_argument("--sample", action="store_true", help="send a seeded synthetic event instead")
    p.add_argument("--image", help="a JPEG, PNG or .npy image file: the event's 'image' (base64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--url", type=http_url, default="http://127.0.0.1:8080", help="the gateway (default %(default)s)"
    )
    p.add_argument("--timeout", type=positive_seconds, default=None, help="seconds (> 0)")
    p.add_argument("--token-file", help="a file holding the gateway's bearer token")
    p.set_defaults(handler=cmd_invoke)


def _burst_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "path", help="workflow YAML file or bundled workflow name (traffic, image-processing, social-media)"
    )
    p.add_argument("--requests", "-n", type=positive_int, default=16, help="requests to send (default 16)")
    p.add_argument(
        "--concurrency", "-c", type=positive_int, default=4, help="most requests outstanding (default 4)"
    )
    p.add_argument(
        "--warmup",
        type=non_negative_int,
        default=0,
        help="requests sent first, one at a time, not counted (default 0)",
    )
    p.add_argument(
        "--system", default=system_default(), choices=SYSTEMS,
        help="streambox (default; STREAMBOX_SYSTEM) | stream-only",
    )
    p.add_argument(
        "--via",
        default="gateway",
        choices=("gateway", "engine"),
        help="gateway (default: through HTTP) | engine (no HTTP)",
    )
    p.add_argument("--input", help="JSON file holding the event (default: a seeded synthetic one each)")
    p.add_argument(
        "--params",
        action="append",
        metavar="[FUNCTION.]KEY=VALUE",
        help="override a function's YAML params, e.g. detect.image_size=96 (repeatable)",
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the report as JSON to PATH")
    add_setting_flags(p, RUN, MECHANISMS, DEVICE)
    add_deprecated_alias(p, "--full-size", "inputs", "full")
    p.set_defaults(handler="streambox.workflows.burst:cmd_burst")


def _replay_arguments(p: argparse.ArgumentParser) -> None:
    from streambox.replay.cli import add_replay_arguments

    add_replay_arguments(p)


MODELS_HELP = "bring your own model: register, list, show, verify or remove models in the pool"


def _models_arguments(p: argparse.ArgumentParser) -> None:
    from streambox.models_cli import add_models_arguments  # argparse only: no torch

    add_models_arguments(p)


def _report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories written by `replay`")
    p.add_argument("--out", help="where to write the plots (default: report/ beside the first run)")
    p.set_defaults(handler="streambox.replay.cli:cmd_report")


def _paper_arguments(p: argparse.ArgumentParser) -> None:
    from streambox.replay.paper.cli import add_paper_arguments  # argparse only: no torch

    add_paper_arguments(p)


#: Every subcommand: name -> (one-line help, description or None, what adds its arguments).
COMMANDS: dict[str, tuple[str, str | None, Callable[[argparse.ArgumentParser], None]]] = {
    "devices": ("list devices with memory used/total and streams", None, _devices_arguments),
    "demo": (
        "run every zoo model through its kernel plan on the (emulated) GPU and report memory",
        None,
        _demo_arguments,
    ),
    "compile": (
        "compile a zoo model's kernels to persistent-thread-block CUDA (needs the 'compiler' extra)",
        None,
        _compile_arguments,
    ),
    "validate": ("check workflow YAML files (file, line and field on errors)", None, _validate_arguments),
    "serve": ("serve workflows over HTTP, one API proxy per workflow", None, _serve_arguments),
    "invoke": ("send one request to a running gateway", None, _invoke_arguments),
    "replay": (
        "replay an Azure Functions trace against a system, open loop, into a run directory",
        "Replay Azure Functions invocations against a workflow on a system and record every request and "
        "the system's memory. Without --trace, the shipped sample (real 2019 rows) is used.",
        _replay_arguments,
    ),
    "report": (
        "comparison plots (PNG) and table of replay runs",
        "Draw memory over time, mean memory, throughput, latency CDF and SLO violations of replay runs, "
        "and print their comparison table.",
        _report_arguments,
    ),
    "paper": (
        "reproduce an evaluation figure of the paper (12-19): measure, plot, table ours beside the paper's",
        "Run the measurement a figure of the StreamBox paper (ATC'24, section 9) needs (replays of the "
        "shipped Azure sample, the benchmarks), write its plots and a table of our numbers beside the "
        "paper's with the ratio into OUT/figNN/. docs/reproduction.md lists each figure.",
        _paper_arguments,
    ),
    "models": (MODELS_HELP, None, _models_arguments),
    "burst": (
        "deploy a workflow on its API proxy, send a burst of requests, report latency and memory",
        "Deploy a workflow on a real API proxy (the emulated GPU by default), send N requests with at "
        "most C outstanding through the HTTP gateway (or straight to the engine), and print latency "
        "percentiles, cold starts, a per-function breakdown and device/pool memory.",
        _burst_arguments,
    ),
}


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The command line; `commands`: the subcommands to give their arguments (None: all; the others
    are listed with their help line only)."""
    wanted = set(COMMANDS) if commands is None else set(commands)
    parser = argparse.ArgumentParser(
        prog="streambox",
        description="StreamBox: serverless inference functions sharing one GPU runtime through streams.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (summary, description, add_arguments) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=summary, description=description or summary)
        if name in wanted:
            add_arguments(sub)
    return parser


def _command_in(argv: Sequence[str]) -> list[str]:
    """The subcommand named on the command line (the first word that is not an option), if any."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return [word] if word in COMMANDS else []


def command_handler(args: argparse.Namespace) -> Callable[[argparse.Namespace], int]:
    handler = args.handler
    if isinstance(handler, str):  # "module:function": imported only now that it runs
        module, _, name = handler.partition(":")
        handler = getattr(importlib.import_module(module), name)
    return handler


def _message(error: Exception) -> object:
    """What an error says: a plain KeyError's key without its quotes; a KeyError subclass that words
    its own message (`UnknownModelError`: the known models too) says that."""
    if isinstance(error, KeyError) and type(error).__str__ is KeyError.__str__ and error.args:
        return error.args[0]
    return error


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(_command_in(argv)).parse_args(argv)
    try:
        for line in unknown_environment(os.environ):
            print(f"streambox {args.command}: note: {line}", file=sys.stderr)
        return int(command_handler(args)(args))
    except KeyboardInterrupt as interrupted:  # Ctrl-C: one line, the status a shell gives it
        why = f": {interrupted}" if str(interrupted) else ""
        print(f"streambox {args.command}: interrupted{why}", file=sys.stderr)
        return 130
    except Exception as error:
        # A DeviceError can only come from the device package once imported (it imports torch).
        device = sys.modules.get("streambox.device")
        proxy = sys.modules.get("streambox.api_proxy.errors")  # a proxy that did not start, ...
        told = (*((device.DeviceError,) if device else ()), *((proxy.ProxyError,) if proxy else ()))
        if not isinstance(error, (ValueError, KeyError, OSError, *told)):
            raise
        # Configuration mistakes and what the system refused (a path that cannot be written, a port
        # in use) get one clear line, not a traceback.
        message = _message(error)
        print(f"streambox {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
