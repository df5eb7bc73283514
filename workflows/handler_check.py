"""Checking a workflow's handlers without running their code in the calling process.

`check_target(ref, base_dir)`: a handler's module must be the workflow's own code, found without
importing anything: a module (or package) in the workflow's folder (the YAML's `base_dir`), or one of
StreamBox's bundled examples (`streambox.workflows.examples.*`). Standard-library, built-in and
already-imported modules are refused by name, so `os:execv` or `builtins:eval` never pass, even with
an `os.py` planted beside the YAML (the interpreter would import the real `os`).

`inspect_handlers(refs, base_dir)`: imports the handlers in a child process, which checks that each
is a function taking `(ctx, event)` and reads the models it declares. A module that crashes, exits
or hangs at import fails its own check, with the exit code; the caller (the gateway, `validate`)
never imports it. Results are cached per (handlers, folder, module files' modification times).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from functools import cache
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path
from typing import Any

from .handlers import HandlerError, missing_attribute

EXAMPLES_PACKAGE = "streambox.workflows.examples"
INSPECT_TIMEOUT_S = 120.0
_CHILD = "from streambox.workflows.handler_check import _inspect_main; _inspect_main()"


def _examples_dir() -> Path:
    return Path(__file__).parent / "examples"


def _find(name: str, roots: list[str]) -> ModuleSpec | None:
    """The spec of dotted `name` under `roots`, package by package, executing nothing."""
    spec, where = None, roots
    parts = name.split(".")
    for i in range(len(parts)):
        spec = PathFinder.find_spec(".".join(parts[: i + 1]), where)
        if spec is None:
            return None
        where = list(spec.submodule_search_locations or [])
        if i < len(parts) - 1 and not where:
            return None  # a module, not a package, in the middle of the name
    return spec


def check_target(ref: str, base_dir: Path | None) -> Path:
    """The file of `ref`'s module if it is the workflow's own code (see the module), else
    `HandlerError` saying what is allowed."""
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise HandlerError(f"handler {ref!r} is not of the form module:function")
    allowed = (
        f"handlers must be modules of the workflow's own code: beside its YAML file"
        f"{f' ({base_dir})' if base_dir is not None else ''} or in {EXAMPLES_PACKAGE}"
    )
    top = module.split(".")[0]
    if module.startswith(EXAMPLES_PACKAGE + "."):
        spec = _find(module[len(EXAMPLES_PACKAGE) + 1 :], [str(_examples_dir())])
    elif top in sys.stdlib_module_names or top in sys.builtin_module_names or top == "streambox":
        raise HandlerError(f"handler {ref!r}: {top!r} is not the workflow's code ({allowed})")
    elif base_dir is None:
        raise HandlerError(f"handler {ref!r}: the workflow has no folder to hold its code ({allowed})")
    else:
        spec = _find(module, [str(Path(base_dir).resolve())])
        loaded = getattr(sys.modules.get(top), "__file__", None)
        inside = loaded is None or Path(loaded).resolve().is_relative_to(Path(base_dir).resolve())
        if spec is not None and not inside:
            raise HandlerError(f"handler {ref!r}: {top!r} is already imported from elsewhere ({allowed})")
    if spec is None or spec.origin is None or spec.origin in ("built-in", "frozen"):
        if module.endswith(".py"):  # a file name where a module name goes
            raise HandlerError(
                f"handler {ref!r}: a handler names a module, not a file: did you mean "
                f"'{module[: -len('.py')]}:{attr}'?"
            )
        raise HandlerError(f"cannot import module {module!r}: it is not in the workflow's code ({allowed})")
    return Path(spec.origin)


def inspect_handlers(
    refs: dict[str, str], base_dir: Path | None, timeout_s: float = INSPECT_TIMEOUT_S
) -> dict[str, list[str] | None | HandlerError]:
    """Per function: the models its handler declares (None: none declared), or why it is unusable.
    Each module is imported once per process lifetime of its file (cached by modification time)."""
    modules = {ref.partition(":")[0]: check_target(ref, base_dir) for ref in refs.values()}
    stamps = tuple(sorted((m, str(f), os.stat(f).st_mtime_ns) for m, f in modules.items()))
    reports = dict(_inspect_modules(stamps, str(base_dir) if base_dir is not None else "", timeout_s))
    out: dict[str, list[str] | None | HandlerError] = {}
    for name, ref in refs.items():
        module, _, attr = ref.partition(":")
        report = reports[module]
        if "error" in report:
            out[name] = HandlerError(report["error"])
        elif attr not in report["attrs"]:
            out[name] = missing_attribute(module, attr, report["functions"])
        elif "error" in report["attrs"][attr]:
            out[name] = HandlerError(report["attrs"][attr]["error"].replace(_REF, repr(ref)))
        else:
            out[name] = report["attrs"][attr]["models"]
    return out


_REF = "\0ref\0"  # stands for the handler reference in the child's messages


@cache
def _inspect_modules(
    stamps: tuple[tuple[str, str, int], ...], base_dir: str, timeout_s: float
) -> tuple[tuple[str, Any], ...]:
    """Reports of every module; a child that dies or hangs fails the module it was importing, and a
    new child checks the rest (so the offender fails alone)."""
    reports: dict[str, Any] = {}
    left = [m for m, _, _ in stamps]
    while left:
        code, found = _run_child(left, base_dir, timeout_s)
        if code == -signal.SIGINT:  # Ctrl-C reached the child too: the user's interrupt, not the module's
            raise KeyboardInterrupt
        reports.update(found)
        left = [m for m in left if m not in reports]
        if left:  # the child stopped while importing the first module it did not report
            why = f"exited with code {code}" if code is not None else f"did not finish in {timeout_s:g} s"
            reports[left[0]] = {"error": f"importing module {left[0]!r} {why} (checked in another process)"}
            left = left[1:]
    return tuple(reports.items())


def _run_child(modules: list[str], base_dir: str, timeout_s: float) -> tuple[int | None, dict[str, Any]]:
    request = json.dumps({"modules": modules, "base_dir": base_dir})
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD],
            input=request.encode(),
            capture_output=True,
            timeout=timeout_s,
            cwd=base_dir or None,
        )
        code, output = done.returncode, done.stdout
    except subprocess.TimeoutExpired as exc:
        code, output = None, exc.stdout or b""
    found: dict[str, Any] = {}
    for line in output.decode(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            module, report = json.loads(line)
            found[module] = report
    return code, found


def _inspect_main() -> None:
    """(Child) read {"modules", "base_dir"} on stdin; one JSON line per module on stdout, flushed as it
    goes (so the parent knows which import killed the child). Handlers' own prints go to stderr."""
    from .handlers import check_handler, declared_models, import_handler_module, module_functions

    request = json.loads(sys.stdin.read())
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    base_dir = Path(request["base_dir"]) if request["base_dir"] else None
    for name in request["modules"]:
        try:
            module = import_handler_module(name, base_dir)
        except HandlerError as error:
            report: dict[str, Any] = {"error": str(error)}
        else:
            attrs = {}
            for attr, value in vars(module).items():
                if attr.startswith("__"):
                    continue
                try:
                    attrs[attr] = {"models": declared_models(check_handler(_REF, value))}
                except HandlerError as error:
                    attrs[attr] = {"error": str(error).replace(repr(_REF), _REF)}
                except Exception as error:  # noqa: BLE001 - reported as the handler's problem
                    attrs[attr] = {"error": f"checking {_REF} raised {type(error).__name__}: {error}"}
            report = {"attrs": attrs, "functions": module_functions(module)}
        out.write(json.dumps([name, report]) + "\n")
        out.flush()
