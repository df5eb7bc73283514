"""`streambox models list | add | show | remove | verify`: the models registered in the model pool.

Only argparse at import time (``streambox --help`` imports no torch); each command imports the
registry when it runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from pathlib import Path

from streambox.arg_types import dimensions


def _pool(args: argparse.Namespace, *, create: bool = False) -> Path:
    """The pool to use: `--pool` (which must be a directory; only `add` may create it) or the default."""
    from streambox.config import default_model_pool

    if not args.pool:
        return default_model_pool()
    path = Path(args.pool)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--pool {path}: not a directory")
    if not create and not path.exists():
        raise ValueError(f"--pool {path}: no such directory")
    return path


def _ints(text: str, flag: str) -> list[int]:
    try:
        return list(dimensions(text))
    except ValueError as error:
        raise ValueError(f"{flag} {error}") from None


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def cmd_add(args: argparse.Namespace) -> int:
    from streambox.kernel_compiler import registry

    record = registry.register(
        _pool(args, create=True),
        args.name,
        pt2=args.pt2,
        factory=args.factory,
        weights=args.weights,
        input_shape=_ints(args.input_shape, "--input-shape") if args.input_shape else None,
        input_dtype=args.dtype,
        batches=_ints(args.batch, "--batch"),
        preset=args.preset,
    )
    print(f"registered {record.ref} from {record.source} (sha256 {record.source_sha256[:12]})")
    print(f"input {record.input_dtype} {record.input_shape}, weights {_size(record.weight_bytes)}")
    for b in record.batches:
        print(
            f"  batch {b.batch}: {b.kernels} kernels ({b.fallback_kernels} fallback), peak live "
            f"{_size(b.peak_live_bytes)}, {b.modelled_s * 1e3:.3f} ms modelled on {record.preset}, "
            f"largest difference from eager torch {b.max_abs_diff:.3g}"
        )
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from streambox.kernel_compiler import registry

    corrupt: list[registry.CorruptRecord] = []
    records = registry.registered(_pool(args), corrupt)
    for error in corrupt:  # the others are still listed
        print(f"streambox models: {error}", file=sys.stderr)
    if not records:
        other = "other " if corrupt else ""
        print(f"no {other}registered models in {_pool(args)} (the zoo's models need no registration)")
        return 1 if corrupt else 0
    table = Table(title=f"Registered models in {_pool(args)}")
    columns = (
        "Model",
        "Source",
        "SHA-256",
        "Input",
        "Batches",
        "Weights",
        "Peak live",
        "ms/inference",
        "Lowered",
    )
    for column in columns:
        table.add_column(column)
    for r in records:
        first = r.batches[0]
        table.add_row(
            r.ref,
            f"{r.source_kind}: {r.source}",
            r.source_sha256[:12],
            f"{r.input_dtype} {'x'.join(map(str, r.input_shape))}",
            ",".join(str(b.batch) for b in r.batches),
            _size(r.weight_bytes),
            _size(max(b.peak_live_bytes for b in r.batches)),
            f"{first.modelled_s * 1e3:.3f} (b{first.batch}, {r.preset})",
            datetime.fromisoformat(r.lowered_at).strftime("%Y-%m-%d %H:%M"),
        )
    # Piped output gets wide lines rather than a table folded to 80 columns.
    Console(width=None if sys.stdout.isatty() else 240).print(table)
    print("ms/inference: modelled by kernel_compiler.cost_model for the batch and device preset named")
    return 1 if corrupt else 0


def _record(args: argparse.Namespace):  # -> registry.ModelRecord (lazy import)
    from streambox.kernel_compiler import registry

    record = registry.find(_pool(args), args.model)
    if record is None:
        known = ", ".join(r.ref for r in registry.registered(_pool(args), [])) or "none"
        raise ValueError(f"no registered model {args.model!r} in {_pool(args)} (registered: {known})")
    return record


def cmd_show(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from streambox.kernel_compiler.model_pool import ModelPool

    record = _record(args)
    shown = asdict(record)
    shown["plans"] = [str(e.path) for e in ModelPool(_pool(args)).list() if e.model == record.ref]
    print(json.dumps(shown, indent=1))
    return 0


def cmd_remove(args: argparse.Namespace) -> int:
    from streambox.kernel_compiler import registry
    from streambox.kernel_compiler.model_lease import ModelLeaseError

    try:
        removed = registry.remove(_pool(args), args.model, force=args.force)
    except ModelLeaseError as error:
        print(f"streambox models: error: {error}", file=sys.stderr)
        return 2
    if not removed:
        _record(args)  # raises, naming what is registered
    print(f"removed {', '.join(removed)}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from streambox.kernel_compiler import registry

    record = _record(args)
    for batch, diff in registry.verify(_pool(args), record.ref):
        print(f"{record.ref} batch {batch}: largest difference from eager torch {diff:.3g}")
    return 0


def add_models_arguments(models: argparse.ArgumentParser) -> None:
    """The `models` actions on `models` (streambox.cli's lazy parser calls this)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--pool", help="the model pool directory [STREAMBOX_MODEL_POOL]")
    sub = models.add_subparsers(dest="models_command", metavar="ACTION", required=True)

    add = sub.add_parser(
        "add", parents=[common], help="register the next version of NAME from a .pt2 file or a factory"
    )
    add.add_argument(
        "name", help="model name: lower-case letters, digits, '_' or '-', starting with a letter"
    )
    source = add.add_mutually_exclusive_group(required=True)
    source.add_argument("--pt2", help="a program saved with torch.export.save")
    source.add_argument("--factory", help="package.module:build returning an nn.Module (or (module, shape))")
    add.add_argument("--weights", help="with --factory: a .safetensors or state-dict file")
    add.add_argument("--input-shape", help="input shape without the batch, e.g. 3,32,32 (a .pt2 has its own)")
    add.add_argument("--dtype", help="with --factory: input dtype (default float32; a .pt2 has its own)")
    add.add_argument("--batch", default="1", help="batch sizes to lower now, e.g. 1,4 (default 1)")
    add.add_argument("--preset", default="v100-16gb", help="device preset of the modelled time")
    add.set_defaults(handler=cmd_add)

    list_ = sub.add_parser(
        "list", parents=[common], help="registered models: source, hash, shapes, memory, time"
    )
    list_.set_defaults(handler=cmd_list)
    latest = "name (its latest version) or name@version"
    for name, handler, text, model_help in (
        ("show", cmd_show, "everything recorded about MODEL (name or name@version)", latest),
        ("remove", cmd_remove, "remove MODEL: name@version, or every version of name",
         "name@version, or name: EVERY version of it"),
        ("verify", cmd_verify, "re-run MODEL's stored plans against eager torch", latest),
    ):
        action = sub.add_parser(name, parents=[common], help=text, description=text)
        action.add_argument("model", help=model_help)
        action.set_defaults(handler=handler)
        if name == "remove":
            action.add_argument(
                "--force", action="store_true", help="remove it even while a running server serves it"
            )
