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
