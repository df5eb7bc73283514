"""Bring your own model: models from outside the zoo, registered in the model pool by name and version.

A model comes in one of two forms PyTorch users already have: an exported program saved with
``torch.export.save`` (``.pt2``), or a factory ``package.module:build`` returning an ``nn.Module``
(weights from a safetensors or state-dict file, or whatever the factory set). Registration lowers it
into a kernel plan per declared batch size, profiles each plan (memory per kernel, modelled time per
inference from ``cost_model``), runs each plan on the reference interpreter against eager torch on one
seeded input, and only then publishes the lot.

Layout: ``root/<name>@<version>/`` holds ``model.json`` (the ``ModelRecord``), the model's source
(``source.pt2``, or ``state.safetensors``: the factory module's weights as registered) and one plan
directory per batch in the model pool's own layout (``b<batch>_<shape>/``). The whole directory is
built under a temporary name and renamed into place in one step: a failed registration leaves nothing.
``name`` alone means the latest version. Turning a model into a checked plan: ``model_import``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from pydantic import TypeAdapter, ValidationError
from safetensors.torch import load_model, save_model
from torch import nn
from torch.export.graph_signature import InputKind

from . import model_lease
from .argcodec import dtype_from_name, dtype_name
from .memory_profile import profile_plan
from .model_import import (
    ModelRegistrationError,
    UnsupportedModelError,
    call_factory,
    check_plan,
    example_for,
    first_line,
    load_weights,
    lower_for,
)
from .op_libraries import import_op_libraries
from .plan import PLAN_FILE, KernelPlan, share_weights
from .zoo import ZOO, ModelEntry

__all__ = [
    "BatchReport",
    "CorruptRecord",
    "ModelRecord",
    "ModelRegistrationError",
    "UnsupportedModelError",
    "find",
    "load_module",
    "parse_ref",
    "register",
    "registered",
    "remove",
    "verify",
]

MANIFEST = "model.json"
SOURCE_PT2 = "source.pt2"
STATE_FILE = "state.safetensors"
DEFAULT_PRESET = "v100-16gb"
NAME_PATTERN = re.compile(r"[a-z][a-z0-9_-]{0,63}")  # whole names only (`fullmatch`: "$" took "x\n")
#: Elements of one input sample a registered model may take (a 4K RGB image is 25 million).
MAX_INPUT_ELEMENTS = 1 << 26
MAX_EXAMPLE_ELEMENTS = 1 << 28  # a registered batch's example: 1 GiB of float32


@dataclass
class BatchReport:
    """One lowered batch size: the plan's size, its memory, its modelled time, its check against eager."""

    batch: int
    kernels: int
    fallback_kernels: int
    peak_live_bytes: int  # intermediates and outputs at once, lazy allocation + eager recycling
    modelled_s: float  # per inference on ``ModelRecord.preset``, from kernel_compiler.cost_model
    max_abs_diff: float  # largest |plan - eager| over the outputs, on one seeded input


@dataclass
class ModelRecord:
    """What ``model.json`` says about one registered version."""

    name: str
    version: int
    source_kind: str  # "pt2" or "factory"
    source: str  # the .pt2 file or "package.module:build", as given
    source_sha256: str  # of the .pt2 file, or of the factory's weights as registered
    weights: str | None  # the weights file given with a factory, if any
    input_shape: list[int]  # without the batch dimension
    input_dtype: str
    weight_bytes: int
    preset: str
    lowered_at: str
    torch: str
    batches: list[BatchReport] = field(default_factory=list)

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str | bytes) -> ModelRecord:
        """The record `text` holds, checked field by field (pydantic's `ValidationError` otherwise)."""
        return _record_adapter().validate_json(text)


@functools.cache
def _record_adapter() -> TypeAdapter[ModelRecord]:
    return TypeAdapter(ModelRecord)


class CorruptRecord(ValueError):
    """A `model.json` that holds no model record (edited or damaged outside `streambox models`): the
    message names the file, the field and what is wrong."""


# --- names and lookup ------------------------------------------------------------------------------


def parse_ref(text: str) -> tuple[str, int | None]:
    """``"face@2"`` -> ``("face", 2)``; ``"face"`` -> ``("face", None)`` (the latest)."""
    name, at, version = text.partition("@")
    if not NAME_PATTERN.fullmatch(name):
        raise ValueError(
            f"model name {name!r} must be lower-case letters, digits, '_' or '-', starting with a letter"
        )
    if not at:
        return name, None
    if not version.isdigit() or int(version) < 1:
        raise ValueError(f"model version in {text!r} must be a positive integer (e.g. {name}@1)")
    return name, int(version)


def _versions(root: Path, name: str) -> list[int]:
    if not root.is_dir():
        return []
    found = []
    for d in root.glob(f"{name}@*"):
        version = d.name.partition("@")[2]
        if version.isdigit() and (d / MANIFEST).exists():
            found.append(int(version))
    return sorted(found)


#: Beside the pool's models, `name@version.removed` marks a removed version: a version number names
#: one model for good (a process pinned to `tiny@2` must never get another model under that name).
REMOVED_SUFFIX = ".removed"


#: A registration's or lowering's working folder (`.tmp-*`, `.trash-*`) older than this was left by a
#: process that was killed meanwhile: it is removed (a live one renames its folder within minutes).
UNFINISHED_AGE_S = 6 * 3600.0


def sweep_unfinished(folder: Path, age_s: float = UNFINISHED_AGE_S) -> list[Path]:
    """Remove the working folders in `folder` that killed registrations or lowerings left; returns them.
    docs/models.md: a failure leaves nothing in the pool, a kill -9 included, once this has run."""
    now, gone = datetime.now(UTC).timestamp(), []
    for path in folder.glob(".*"):
        if path.name.startswith((".tmp-", ".trash-")) and path.is_dir():
            with contextlib.suppress(OSError):
                if now - path.stat().st_mtime > age_s:
                    shutil.rmtree(path)
                    gone.append(path)
    return gone


def _removed_versions(root: Path, name: str) -> list[int]:
    found = [p.name[len(name) + 1 : -len(REMOVED_SUFFIX)] for p in root.glob(f"{name}@*{REMOVED_SUFFIX}")]
    return [int(v) for v in found if v.isdigit()]


def read_record(model_dir: Path) -> ModelRecord:
    """The record of the registered version in `model_dir`; `CorruptRecord` if its `model.json` is none."""
    path = model_dir / MANIFEST
    try:
        record = ModelRecord.from_json(path.read_bytes())
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        problem = f"{where}: {first['msg']}" if where else first["msg"]
    else:
        if record.batches:
            return record
        problem = "batches: no lowered batch size"
    raise CorruptRecord(
        f"{path}: not a model record ({problem}); remove it (`streambox models remove {model_dir.name}`) "
        "and register the model again"
    )


def find(root: Path, ref: str) -> ModelRecord | None:
    """The registered version ``ref`` names (``name``: the latest), or None."""
    if "@" not in ref and not NAME_PATTERN.fullmatch(ref):
        return None
    try:
        name, version = parse_ref(ref)
    except ValueError:
        return None
    versions = _versions(root, name)
    if version is None:
        version = versions[-1] if versions else None
    if version not in versions:
        return None
    return read_record(root / f"{name}@{version}")


def registered(root: Path, corrupt: list[CorruptRecord] | None = None) -> list[ModelRecord]:
    """Every registered version in the pool, by name then version. A corrupt record raises
    `CorruptRecord`, or with `corrupt` given is appended there and left out."""
    if not root.is_dir():
        return []
    records = []
    for d in root.iterdir():
        if "@" in d.name and (d / MANIFEST).exists():
            try:
                records.append(read_record(d))
            except CorruptRecord as error:
                if corrupt is None:
                    raise
                corrupt.append(error)
    return sorted(records, key=lambda r: (r.name, r.version))


def as_entry(root: Path, record: ModelRecord) -> ModelEntry:
    """A registered model seen as a zoo entry, so the runtime treats both alike."""
    return ModelEntry(
        name=record.ref,
        builder=lambda: load_module(root, record),
        input_shape=tuple(record.input_shape),
        input_dtype=dtype_from_name(record.input_dtype),
        description=f"registered from {record.source}",
        source="registered",
        small_input_shape=tuple(record.input_shape),
    )


# --- building the module ---------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_module(root: Path, record: ModelRecord) -> nn.Module:
    """The eager module of a registered version, from the copy the pool keeps."""
    model_dir = root / record.ref
    if record.source_kind == "pt2":
        import_op_libraries()  # the program may name torchvision's ops
        return torch.export.load(model_dir / SOURCE_PT2).module()
    module, _ = call_factory(record.source)
    try:
        load_model(module, str(model_dir / STATE_FILE))
    except OSError:  # the file cannot be read now: the host's failure, not the model's
        raise
    except Exception as error:  # the factory's code changed since it was registered, or the file did
        raise ModelRegistrationError(
            str(model_dir / STATE_FILE),
            f"{record.ref}'s registered weights do not fit what its factory {record.source} builds now "
            f"(was its code changed since? register it again): {first_line(error)}",
        ) from None
    return module.eval()


def lower_registered(root: Path, record: ModelRecord, batch: int, shape: tuple[int, ...]) -> KernelPlan:
    """A plan for a batch or shape the model was not registered with (lowered on first use)."""
    source = str(root / record.ref / SOURCE_PT2) if record.source_kind == "pt2" else record.source
    example = example_for(shape, dtype_from_name(record.input_dtype), batch)
    return lower_for(source, record.ref, load_module(root, record), example)


# --- registration ----------------------------------------------------------------------------------


@dataclass
class _Source:
    """What ``register`` lowers: the eager module, its input, and where it came from."""

    file: str  # the .pt2 file (absolute) or the factory, as errors and the record name it
    eager: nn.Module
    shape: tuple[int, ...]
    dtype: torch.dtype
    weights: Path | None = None  # a factory's weights file (absolute)
    program: Any = None  # the loaded ExportedProgram of a .pt2 file
    static_batch: int | None = None  # the only batch a .pt2 exported with a static batch serves


#: Batch sizes a registration lowers at most (a function batches up to 64: api_proxy.function_spec).
MAX_BATCH = 1024
#: Input dtypes a registered model may take (its example inputs are drawn in them).
INPUT_DTYPES = (
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool",
)  # fmt: skip


def _checked_batches(
    base: str, version: int | None, pt2: object, factory: object, weights: object, batches: Sequence[int]
) -> list[int]:
    """The sorted batch sizes, once the registration's arguments are checked to go together."""
    if version is not None:
        raise ValueError(f"give the name without a version ({base!r}); registration picks the next one")
    if base in ZOO:
        raise ValueError(f"{base!r} is a zoo model; register under another name")
    if (pt2 is None) == (factory is None):
        raise ValueError("give exactly one of a .pt2 file or a package.module:build factory")
    if weights is not None and factory is None:
        raise ValueError("weights go with a factory; a .pt2 file carries its own")
    checked = sorted({int(b) for b in batches})
    if not checked or checked[0] < 1 or checked[-1] > MAX_BATCH:
        raise ValueError(f"batch sizes must be integers from 1 to {MAX_BATCH}, got {list(checked)}")
    return checked


@contextlib.contextmanager
def _export_log_held() -> Iterator[list[logging.LogRecord]]:
    """What `torch.export` logs meanwhile, held instead of printed: `torch.export.load` logs a corrupt
    file's whole traceback as a warning before it raises, and the error then says it once."""
    export_log = logging.getLogger("torch.export")
    held: list[logging.LogRecord] = []

    def hold(record: logging.LogRecord) -> bool:
        held.append(record)
        return False

    export_log.addFilter(hold)
    try:
        yield held
    finally:
        export_log.removeFilter(hold)


def _last_line(record: logging.LogRecord) -> str:
    """A logged traceback's last line (the exception), or the message's."""
    text = record.getMessage()
    if record.exc_info:
        text += "\n" + "".join(traceback.format_exception(*record.exc_info))
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _from_pt2(pt2: Path | str, batches: list[int], input_shape: Sequence[int] | None) -> _Source:
    file = str(Path(pt2).resolve())
    if not Path(pt2).is_file():
        raise ModelRegistrationError(file, "no such file")
    import_op_libraries()  # the program may name torchvision's ops
    with _export_log_held() as held:
        try:
            program = torch.export.load(pt2)
        except Exception as error:
            cause = _last_line(held[-1]) if held else ""
            why = first_line(error) + (f"; {cause}" if cause and cause not in first_line(error) else "")
            raise ModelRegistrationError(file, f"not a torch.export.save file ({why})") from None
    for record in held:  # a file that loads: its notes (an older format's deprecation) as torch logs them
        logging.getLogger(record.name).handle(record)
    eager = program.module()
    user_inputs = [s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    if len(user_inputs) != 1:
        raise UnsupportedModelError(file, f"the program takes {len(user_inputs)} tensor inputs, not one")
    val = next(n for n in program.graph.nodes if n.name == user_inputs[0]).meta["val"]
    if len(val.shape) < 2:  # a scalar, or one value per sample: no (batch, input shape) to serve
        batch_of = "a model's input is a batch of samples of one or more dimensions"
        raise UnsupportedModelError(file, f"input shape {list(val.shape)}: {batch_of}")
    if any(not isinstance(d, int) for d in val.shape[1:]):
        raise UnsupportedModelError(file, f"input shape {list(val.shape)} is dynamic beyond the batch")
    dtype, shape = val.dtype, tuple(val.shape[1:])
    # A batch exported static serves that batch only; a dynamic one (torch.export.Dim) serves any.
    static_batch = val.shape[0] if isinstance(val.shape[0], int) else None
    if static_batch is not None and (others := [b for b in batches if b != static_batch]):
        raise ModelRegistrationError(
            file,
            f"was exported for batch {static_batch} only, so it cannot serve batch sizes {others}: "
            "export with dynamic_shapes={'x': {0: torch.export.Dim('batch')}} or register batch "
            f"{static_batch}",
        )
    if input_shape is not None and tuple(input_shape) != shape:
        raise ModelRegistrationError(
            file, f"was exported for input shape {list(shape)}, not {list(input_shape)}"
        )
    _check_input(file, shape, str(dtype).removeprefix("torch."))  # as a factory's: a .pt2 skipped them
    return _Source(file, eager, shape, dtype, program=program, static_batch=static_batch)


def _check_input(file: str, shape: Sequence[int], dtype: str) -> None:
    """A model's input (without the batch): a dtype the runtime carries, and a shape of at least one
    dimension, each at least 1, of at most `MAX_INPUT_ELEMENTS` elements."""
    if dtype not in INPUT_DTYPES:
        raise ModelRegistrationError(file, f"input dtype {dtype!r} is not one of {', '.join(INPUT_DTYPES)}")
    if not shape or min(shape) < 1 or math.prod(shape) > MAX_INPUT_ELEMENTS:
        raise ModelRegistrationError(
            file,
            f"input shape {list(shape)}: each dimension >= 1 and at most {MAX_INPUT_ELEMENTS:,} elements "
            "per sample (registration lowers and checks it on the CPU)",
        )


def _from_factory(
    factory: str, weights: Path | str | None, input_shape: Sequence[int] | None, input_dtype: str
) -> _Source:
    file = str(factory)
    eager, factory_shape = call_factory(str(factory))
    resolved = None
    if weights is not None:
        if not Path(weights).is_file():
            raise ModelRegistrationError(str(weights), "no such file")
        resolved = Path(weights).resolve()
        load_weights(eager, resolved)
    shape = tuple(input_shape) if input_shape is not None else factory_shape
    if shape is None:
        raise ModelRegistrationError(
            file,
            "no input shape: pass one, or have the factory return (module, shape) or set "
            "module.example_input_shape",
        )
    _check_input(file, shape, input_dtype)
    return _Source(file, eager, shape, dtype_from_name(input_dtype), weights=resolved)


def _lower_batches(
    model_dir: Path, ref: str, source: _Source, batches: list[int], preset: str
) -> tuple[list[BatchReport], int]:
    """Lower, check and profile every batch into ``model_dir``: (a report each, the weight bytes)."""
    reports, weight_bytes = [], 0
    for batch in batches:
        example = example_for(source.shape, source.dtype, batch)
        exact = source.program is not None and batch == source.static_batch
        plan = lower_for(
            source.file, ref, source.eager, example, source.program if exact else None, check_input=True
        )
        diff = check_plan(source.file, plan, source.eager, example)
        profile = profile_plan(plan)
        plan_dir = model_dir / f"b{batch}_{'x'.join(map(str, source.shape))}"
        plan.save(plan_dir)
        share_weights(plan_dir, model_dir)  # one weights file for the model's batches
        (plan_dir / "memory_profile.json").write_text(profile.to_json())
        weight_bytes = plan.weight_bytes
        reports.append(
            BatchReport(
                batch=batch,
                kernels=len(plan.kernels),
                fallback_kernels=plan.fallback_count,
                peak_live_bytes=profile.peak_eager,
                modelled_s=sum(plan.kernel_seconds(preset)),
                max_abs_diff=diff,
            )
        )
    return reports, weight_bytes


def register(
    root: Path | str,
    name: str,
    *,
    pt2: Path | str | None = None,
    factory: str | None = None,
    weights: Path | str | None = None,
    input_shape: Sequence[int] | None = None,
    input_dtype: str | None = None,
    batches: Sequence[int] = (1,),
    preset: str = DEFAULT_PRESET,
) -> ModelRecord:
    """Register the next version of ``name`` from a ``.pt2`` file or a factory; all or nothing.
    `input_dtype`: a factory's input dtype (default float32); a .pt2 file carries its own."""
    root = Path(root)
    base, version = parse_ref(name)
    sizes = _checked_batches(base, version, pt2, factory, weights, batches)
    if pt2 is not None:
        if input_dtype is not None:  # it was ignored: the program's own dtype was registered
            raise ValueError(
                f"an input dtype ({input_dtype}) goes with a factory; a .pt2 file carries its own"
            )
        source = _from_pt2(pt2, sizes, input_shape)
    else:
        source = _from_factory(str(factory), weights, input_shape, input_dtype or "float32")
    if max(sizes) * math.prod(source.shape) > MAX_EXAMPLE_ELEMENTS:  # built on the CPU to lower and check
        raise ModelRegistrationError(
            source.file, f"batch {max(sizes)} of input shape {list(source.shape)} is more than "
            f"{MAX_EXAMPLE_ELEMENTS:,} elements: registration builds and runs that example on the CPU",
        )

    root.mkdir(parents=True, exist_ok=True)
    sweep_unfinished(root)
    number = max([0, *_versions(root, base), *_removed_versions(root, base)]) + 1
    ref = f"{base}@{number}"
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{ref}-", dir=root))
    try:
        if pt2 is not None:
            shutil.copyfile(pt2, tmp / SOURCE_PT2)
            digest = _sha256(tmp / SOURCE_PT2)
        else:
            save_model(source.eager, str(tmp / STATE_FILE))
            digest = _sha256(tmp / STATE_FILE)
        reports, weight_bytes = _lower_batches(tmp, ref, source, sizes, preset)
        record = ModelRecord(
            name=base,
            version=number,
            source_kind="pt2" if pt2 is not None else "factory",
            source=source.file,
            source_sha256=digest,
            weights=str(source.weights) if source.weights is not None else None,
            input_shape=list(source.shape),
            input_dtype=dtype_name(source.dtype),
            weight_bytes=weight_bytes,
            preset=preset,
            lowered_at=datetime.now(UTC).isoformat(timespec="seconds"),
            torch=torch.__version__,
            batches=reports,
        )
        (tmp / MANIFEST).write_text(record.to_json())
        try:
            os.rename(tmp, root / ref)  # fails if a concurrent registration took this version first
        except OSError as error:
            if not (root / ref).exists():
                raise
            raise RegisteredMeanwhile(
                f"{ref} was registered by another command meanwhile; add {base!r} again for the next version"
            ) from error
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return record


class RegisteredMeanwhile(ValueError):
    """Another process registered the version this registration was about to take (nothing was kept)."""


def verify(root: Path | str, ref: str) -> list[tuple[int, float]]:
    """Re-run every stored plan of ``ref`` against eager torch: (batch, largest difference) each."""
    root = Path(root)
    record = find(root, ref)
    if record is None:
        raise KeyError(ref)
    eager = load_module(root, record)
    results = []
    for d in sorted((root / record.ref).iterdir()):
        if not (d / PLAN_FILE).exists():
            continue
        plan = KernelPlan.load(d)
        example = example_for(plan.input_shape, dtype_from_name(plan.input_dtype), plan.batch)
        results.append((plan.batch, check_plan(str(d), plan, eager, example)))
    return results


def remove(root: Path | str, ref: str, *, force: bool = False) -> list[str]:
    """Remove ``name@version``, or every version of ``name``; returns what was removed. A version that
    another running process serves (`model_lease`) is refused with `ModelInUse`, and then nothing is
    removed; `force` removes it anyway."""
    root = Path(root)
    name, version = parse_ref(ref)
    targets = [
        (f"{name}@{v}", root / f"{name}@{v}")
        for v in (_versions(root, name) if version is None else [version])
        if (root / f"{name}@{v}" / MANIFEST).exists()
    ]
    with model_lease.exclusive([] if force else targets) as leased:
        gone = []
        for found, target in targets:
            if not force and found not in leased:
                continue  # another removal took it meanwhile
            # Rename first so readers never see a half-deleted model.
            (root / f"{found}{REMOVED_SUFFIX}").touch()  # first: a registration meanwhile takes the next
            trash = Path(tempfile.mkdtemp(prefix=f".trash-{found}-", dir=root))
            try:
                os.rename(target, trash / "model")
            except FileNotFoundError:  # another removal took it meanwhile
                continue
            finally:
                shutil.rmtree(trash, ignore_errors=True)
            gone.append(found)
        return gone
