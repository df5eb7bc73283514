"""Handler references are the workflow's own code, and the gateway never imports them: `os:execv`
or `builtins:eval` fail validation, and a module that exits or hangs at import fails its own check
in a child process while the validating process carries on."""

from __future__ import annotations

import sys

import pytest

from streambox.workflows.handler_check import check_target, inspect_handlers
from streambox.workflows.handlers import HandlerError
from streambox.workflows.validation import WorkflowValidationError, parse_spec

ALLOWED = "handlers must be modules of the workflow's own code"


def _spec(handler: str) -> str:
    return f"name: t\nslo_ms: 100\nfunctions:\n  a: {{handler: '{handler}'}}\n"


@pytest.mark.parametrize("ref", ["os:execv", "builtins:eval", "subprocess:run", "streambox.sdk:function"])
def test_targets_outside_the_workflow_are_refused(tmp_path, ref):
    with pytest.raises(WorkflowValidationError) as caught:
        parse_spec(_spec(ref), "t.yaml", tmp_path)
    assert f"t.yaml:4:7: functions.a.handler: handler {ref!r}: " in str(caught.value)
    assert ALLOWED in str(caught.value)


def test_a_planted_stdlib_name_beside_the_yaml_is_still_refused(tmp_path):
    (tmp_path / "os.py").write_text("def execv(ctx, event):\n    return 1\n")
    with pytest.raises(HandlerError, match="'os' is not the workflow's code"):
        check_target("os:execv", tmp_path)


def test_own_modules_and_packages_and_the_bundled_examples_pass(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "mod.py").write_text("def run(ctx, event):\n    return event\n")
    assert check_target("pkg.mod:run", tmp_path) == tmp_path / "pkg" / "mod.py"
    assert check_target("streambox.workflows.examples.traffic:detect", None).name == "traffic.py"
    with pytest.raises(HandlerError, match="not in the workflow's code"):
        check_target("pkg.nope:run", tmp_path)


def test_a_module_that_exits_at_import_fails_alone_and_is_never_imported_here(tmp_path):
    (tmp_path / "exits_at_import.py").write_text("import os\nos._exit(7)\n")
    (tmp_path / "fine_mod.py").write_text("def run(ctx, event):\n    return 1\n")
    text = (
        "name: t\nslo_ms: 100\nfunctions:\n"
        "  good: {handler: fine_mod:run}\n"
        "  bad: {handler: exits_at_import:run}\n"
    )
    with pytest.raises(WorkflowValidationError) as caught:
        parse_spec(text, "t.yaml", tmp_path)
    assert str(caught.value) == (
        "t.yaml:5:9: functions.bad.handler: importing module 'exits_at_import' exited with code 7 "
        "(checked in another process)"
    )
    assert "exits_at_import" not in sys.modules and "fine_mod" not in sys.modules


def test_a_module_that_hangs_at_import_times_out(tmp_path):
    (tmp_path / "hangs_at_import.py").write_text("import time\ntime.sleep(60)\n")
    (out,) = inspect_handlers({"a": "hangs_at_import:run"}, tmp_path, timeout_s=1.0).values()
    assert isinstance(out, HandlerError)
    assert "importing module 'hangs_at_import' did not finish in 1 s" in str(out)
