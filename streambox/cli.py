"""The `streambox` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from streambox.config import Config
from streambox.device import DeviceError


def _add_device_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", help="device backend: emulated (default) or cuda [STREAMBOX_BACKEND]")
    parser.add_argument(
        "--device-preset",
        help="emulated device preset: v100-16gb (default), h100-80gb [STREAMBOX_DEVICE_PRESET]",
    )
    parser.add_argument("--gpus", type=int, help="number of emulated GPUs (default 1) [STREAMBOX_GPUS]")


def _config(args: argparse.Namespace) -> Config:
    return Config.from_env().with_overrides(
        backend=args.backend, device_preset=args.device_preset, gpus=args.gpus
    )


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

    shape = tuple(int(d) for d in args.input_shape.split("x")) if args.input_shape else None
    pool_root = args.out if args.out is not None else _config(args).model_pool
    try:
        report = compile_model(
            args.model, args.arch, pool_root, args.batch, shape, nvcc=False if args.no_nvcc else None
        )
    except CompilerUnavailable as error:
        print(f"streambox compile: error: {error}", file=sys.stderr)
        return 2
    print(report.summary())
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    """Check workflow YAML files; every mistake is reported with file, line and field."""
    from streambox.workflows.commands import resolve_workflow_path
    from streambox.workflows.validation import validate_file

    for path in args.paths:
        spec = validate_file(resolve_workflow_path(path))
        counts = f"{len(spec.functions)} functions, {len(spec.edges)} edges"
        print(f"{path}: workflow {spec.name!r} is valid: {counts}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve workflows through the HTTP gateway, one API proxy per workflow."""
    from streambox.workflows.commands import proxy_options_from, serve
    from streambox.workflows.proxy_invoker import ProxyInvoker

    options = proxy_options_from(args)
    if args.system == "monolithic":
        from streambox.workflows.monolithic import MonolithicInvoker

        if options:
            raise ValueError(f"--system monolithic has no proxy; drop {', '.join(sorted(options))}")
        factory = MonolithicInvoker.factory()
    else:
        factory = ProxyInvoker.factory(proxy_options=options)
    serve(
        args.paths,
        host=args.host,
        port=args.port,
        system=args.system,
        config=_config(args),
        invoker_factory=factory,
        on_ready=lambda url: print(f"serving on {url} (Ctrl-C stops)", flush=True),
        small=args.small,
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

        event = {**event, "image": image_field(Path(args.image).read_bytes())}
    try:
        response = invoke(args.name, event, url=args.url, timeout_s=args.timeout)
    except GatewayUnreachable as error:
        print(f"streambox invoke: error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(response.body, indent=1))
    return 0 if response.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streambox",
        description="StreamBox: serverless inference functions sharing one GPU runtime through streams.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    devices = commands.add_parser("devices", help="list devices with memory used/total and streams")
    _add_device_options(devices)
    devices.set_defaults(handler=cmd_devices)

    demo = commands.add_parser(
        "demo", help="run every zoo model through its kernel plan on the (emulated) GPU and report memory"
    )
    _add_device_options(demo)
    demo.add_argument("--models", nargs="*", help="zoo models to run (default: all)")
    demo.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    demo.set_defaults(handler=cmd_demo)

    compile_ = commands.add_parser(
        "compile",
        help="compile a zoo model's kernels to persistent-thread-block CUDA (needs the 'compiler' extra)",
    )
    _add_device_options(compile_)
    compile_.add_argument("model", help="zoo model name")
    compile_.add_argument("--arch", default="sm_90", help="CUDA architecture, sm_75 to sm_90 (default sm_90)")
    compile_.add_argument("--out", type=Path, help="model pool directory (default: STREAMBOX_MODEL_POOL)")
    compile_.add_argument("--batch", type=int, default=1)
    compile_.add_argument("--input-shape", help="input shape without the batch, e.g. 3x224x224")
    compile_.add_argument("--no-nvcc", action="store_true", help="emit CUDA C only")
    compile_.set_defaults(handler=cmd_compile)

    validate = commands.add_parser(
        "validate", help="check workflow YAML files (file, line and field on errors)"
    )
    validate.add_argument("paths", nargs="+", help="workflow YAML files or bundled workflow names")
    validate.set_defaults(handler=cmd_validate)

    serve = commands.add_parser("serve", help="serve workflows over HTTP, one API proxy per workflow")
    _add_device_options(serve)
    serve.add_argument("paths", nargs="+", help="workflow YAML files or bundled workflow names")
    serve.add_argument(
        "--system",
        default="streambox",
        choices=("streambox", "stream-only", "monolithic"),
        help="streambox (default), stream-only (the proxy with StreamBox's mechanisms off) or monolithic "
        "(the baseline: a process and a runtime per function instance, data through Redis)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--small", action="store_true", help="use the zoo's small input shapes")
    from streambox.workflows.commands import add_proxy_options

    add_proxy_options(serve)
    serve.set_defaults(handler=cmd_serve)

    invoke = commands.add_parser("invoke", help="send one request to a running gateway")
    invoke.add_argument("name", help="workflow name")
    invoke.add_argument("--input", help="JSON file holding the event")
    invoke.add_argument("--sample", action="store_true", help="send a seeded synthetic event instead")
    invoke.add_argument("--image", help="a JPEG, PNG or .npy image file: the event's 'image' (base64)")
    invoke.add_argument("--seed", type=int, default=0)
    invoke.add_argument("--url", default="http://127.0.0.1:8080")
    invoke.add_argument("--timeout", type=float, default=None, help="seconds")
    invoke.set_defaults(handler=cmd_invoke)

    from streambox.replay.cli import add_commands as add_replay_commands

    add_replay_commands(commands)

    from streambox.workflows.burst import add_commands as add_burst_commands

    add_burst_commands(commands)

    from streambox.models_cli import add_commands as add_models_commands  # argparse only: no torch

    add_models_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except (ValueError, KeyError, DeviceError) as error:
        # Configuration mistakes get one clear line, not a traceback.
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"streambox {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
