"""The model pool: lowered plans on disk, keyed by model, batch and input shape.

Models are the zoo's and those registered here (``registry``: ``root/<name>@<version>/``, ``name``
alone meaning the latest version); ``entry`` resolves either kind.

Layout: ``root/<model>/b<batch>_<d0>x<d1>x.../`` holding ``plan.json``, ``weights.safetensors`` and
``memory_profile.json``; a model's plans share one weights file (hard links, `share_weights`). A plan
directory is written under a temporary name beside its final place and renamed into place in one
step, so a reader (another process included) sees either no plan or a whole one. Two processes
lowering the same key at once both do the work; the first rename wins and the second discards its
copy.
"""

from __future__ import annotations

import contextlib
import json
import numbers
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import model_lease, registry
from .calibration import CALIBRATION_DIR
from .lowering import lower_model
from .memory_profile import MemoryProfile, profile_plan
from .plan import PLAN_FILE, SCHEMA_VERSION, KernelPlan, StalePlan, share_weights
from .zoo import ZOO, ModelEntry, UnknownModelError

PROFILE_FILE = "memory_profile.json"
ENV_ROOT = "STREAMBOX_MODEL_POOL"

LowerFn = Callable[[str, int, tuple[int, ...]], KernelPlan]
#: A plan's key in the pool: model, batch, input shape without the batch.
PlanKey = tuple[str, int, tuple[int, ...]]


def default_root() -> Path:
    env = os.environ.get(ENV_ROOT)
    return Path(env) if env else Path.home() / ".cache" / "streambox" / "model_pool"


def unknown_model(model: str, root: Path | None = None) -> str | None:
    """Why ``model`` names no model of the zoo or of the pool at ``root`` (default: the configured
    one), naming those that exist; None when it names one."""
    try:
        ModelPool(root).entry(model)
    except UnknownModelError as error:
        return str(error)
    return None


@dataclass(frozen=True)
class PoolEntry:
    model: str
    batch: int
    input_shape: tuple[int, ...]
    path: Path


def _shape_key(shape: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in shape)


class ModelPool:
    """Plans on disk; ``get_or_lower`` lowers a (model, batch, shape) only the first time."""

    def __init__(self, root: Path | str | None = None, lower_fn: LowerFn = lower_model) -> None:
        self.root = Path(root) if root is not None else default_root()
        self._lower = lower_fn

    def entry(self, model: str) -> ModelEntry:
        """The zoo entry of ``model``, or a registered model (``name`` or ``name@version``) as one.
        This process then holds the registered version's lease for its life (`model_lease`), so
        `models remove` refuses it while the process serves it."""
        if model in ZOO:
            return ZOO[model]
        record = registry.find(self.root, model)
        if record is None:
            known = list(ZOO) + [r.ref for r in registry.registered(self.root, [])]
            raise UnknownModelError(model, known)
        model_lease.hold(self.root / record.ref)
        return registry.as_entry(self.root, record)

    def path_for(self, model: str, batch: int, input_shape: tuple[int, ...] | None = None) -> Path:
        entry = self.entry(model)
        shape = tuple(input_shape) if input_shape is not None else entry.input_shape
        check_plan_key(model, batch, shape)
        return self.root / entry.name / f"b{batch}_{_shape_key(shape)}"

    def has(self, model: str, batch: int, input_shape: tuple[int, ...] | None = None) -> bool:
        """Whether the pool holds the plan under the current schema (`get_or_lower` lowers a stale
        one again)."""
        try:
            saved = json.loads((self.path_for(model, batch, input_shape) / PLAN_FILE).read_text())
        except (OSError, ValueError):
            return False
        return isinstance(saved, dict) and saved.get("schema_version") == SCHEMA_VERSION

    @property
    def lowers_zoo_models(self) -> bool:
        """Whether this pool lowers with the zoo's lowering (`lower_model`), which another process
        can run for it (`parallel_lowering`), rather than a `lower_fn` of its caller's."""
        return self._lower is lower_model

    def get(self, model: str, batch: int, input_shape: tuple[int, ...] | None = None) -> KernelPlan | None:
        path = self.path_for(model, batch, input_shape)
        return KernelPlan.load(path) if (path / PLAN_FILE).exists() else None

    def get_or_lower(self, model: str, batch: int, input_shape: tuple[int, ...] | None = None) -> KernelPlan:
        entry = self.entry(model)
        shape = tuple(input_shape) if input_shape is not None else entry.input_shape
        final = self.path_for(model, batch, shape)
        if (final / PLAN_FILE).exists():
            try:
                return KernelPlan.load(final)
            except StalePlan:
                _retire(final)
        if not (final / PLAN_FILE).exists():
            plan = self._lower_entry(entry, batch, shape)
            final.parent.mkdir(parents=True, exist_ok=True)
            registry.sweep_unfinished(final.parent)
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=final.parent))
            try:
                plan.save(tmp)
                share_weights(tmp, final.parent)
                (tmp / PROFILE_FILE).write_text(profile_plan(plan).to_json())
                _adopt_calibration(final.with_name(final.name + STALE_SUFFIX), tmp)
                os.rename(tmp, final)
            except OSError:
                if not (final / PLAN_FILE).exists():
                    raise
                # Lost a race with another lowering of the same key: keep the winner's plan.
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        return KernelPlan.load(final)

    def profile(self, model: str, batch: int, input_shape: tuple[int, ...] | None = None) -> MemoryProfile:
        """The memory profile stored with the plan (lowering the plan first if needed)."""
        path = self.path_for(model, batch, input_shape)
        if not (path / PROFILE_FILE).exists():
            plan = self.get_or_lower(model, batch, input_shape)
            tmp = path / f".{PROFILE_FILE}.{os.getpid()}"
            tmp.write_text(profile_plan(plan).to_json())
            os.replace(tmp, path / PROFILE_FILE)
        return MemoryProfile.from_json((path / PROFILE_FILE).read_text())

    def store_profile(self, profile: MemoryProfile) -> Path:
        """Write `profile` beside its plan (e.g. once the kernels' run times are filled in), atomically."""
        path = self.path_for(profile.model, profile.batch, tuple(profile.input_shape))
        if not (path / PLAN_FILE).exists():
            raise FileNotFoundError(f"no plan for {profile.model} batch {profile.batch} at {path}")
        tmp = path / f".{PROFILE_FILE}.{os.getpid()}.{threading.get_ident()}"
        tmp.write_text(profile.to_json())
        os.replace(tmp, path / PROFILE_FILE)
        return path / PROFILE_FILE

    def list(self) -> list[PoolEntry]:
        """Every complete plan in the pool, sorted by model, batch and shape."""
        entries: list[PoolEntry] = []
        if not self.root.is_dir():
            return entries
        for model_dir in sorted(p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")):
            for d in model_dir.iterdir():
                if d.name.startswith(".") or not (d / PLAN_FILE).exists():
                    continue
                batch, _, shape = d.name.partition("_")
                dims = shape.split("x") if shape else []
                if not batch[1:].isdigit() or not all(x.isdigit() for x in dims):
                    continue  # not a plan folder's name (`b<batch>_<shape>`): none of ours
                entries.append(PoolEntry(model_dir.name, int(batch[1:]), tuple(int(x) for x in dims), d))
        return sorted(entries, key=lambda e: (e.model, e.batch, e.input_shape))

    def _lower_entry(self, entry: ModelEntry, batch: int, shape: tuple[int, ...]) -> KernelPlan:
        if entry.source != "registered":
            return self._lower(entry.name, batch, shape)
        record = registry.find(self.root, entry.name)
        assert record is not None  # entry() just found it
        return registry.lower_registered(self.root, record, batch, shape)


def check_plan_key(model: str, batch: int, shape: tuple[int, ...]) -> None:
    """A plan's batch and input shape must be positive integers: checked before anything is lowered
    or written (a batch of 0 lowers to a plan of empty tensors, a negative one fails inside torch)."""
    if not _positive_int(batch):
        raise ValueError(f"model {model!r}: batch must be a positive integer, got {batch!r}")
    if not all(_positive_int(d) for d in shape):
        raise ValueError(
            f"model {model!r}: every input dimension must be a positive integer, got shape {list(shape)}"
        )


def _positive_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


#: A stale plan's folder is moved here while the model is lowered again (its calibration tables, which
#: name the kernels they time and are checked on read, move to the new plan).
STALE_SUFFIX = ".stale"


def _retire(final: Path) -> None:
    """Move a stale plan out of the way (another process may have done it already)."""
    stale = final.with_name(final.name + STALE_SUFFIX)
    shutil.rmtree(stale, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.rename(final, stale)


def _adopt_calibration(stale: Path, fresh: Path) -> None:
    if (stale / CALIBRATION_DIR).is_dir() and not (fresh / CALIBRATION_DIR).exists():
        shutil.copytree(stale / CALIBRATION_DIR, fresh / CALIBRATION_DIR)
    shutil.rmtree(stale, ignore_errors=True)
