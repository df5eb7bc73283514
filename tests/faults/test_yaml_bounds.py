"""Workflow YAML that would expand without bound fails fast, with a clear error and little memory."""

from __future__ import annotations

import resource
import time

import pytest

from streambox.workflows.validation import MAX_NODES, WorkflowValidationError, parse_spec, validate_file

BOMB = """\
a: &a ["x","x","x","x","x","x","x","x","x"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_an_alias_bomb_fails_fast_with_a_clear_error(tmp_path):
    assert len(BOMB) < 500
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    before = _peak_rss_mib()
    t0 = time.perf_counter()
    with pytest.raises(WorkflowValidationError) as caught:
        validate_file(path)
    assert time.perf_counter() - t0 < 1.0
    assert _peak_rss_mib() - before < 50
    message = str(caught.value)
    assert message.startswith(f"{path}:")
    assert "more than 200 uses of YAML aliases" in message


def test_wide_documents_and_deep_nesting_have_limits():
    wide = "name: w\nslo_ms: 1\nfunctions:\n" + "".join(
        f"  f{i}: {{handler: m:f, params: {{a: 1}}}}\n" for i in range(MAX_NODES // 3)
    )
    with pytest.raises(WorkflowValidationError, match=f"expands to more than {MAX_NODES} values"):
        parse_spec(wide, "wide.yaml", check_handlers=False)
    deep = "a: " + "[" * 100 + "]" * 100 + "\n"
    with pytest.raises(WorkflowValidationError, match="nested more than 64 levels"):
        parse_spec(deep, "deep.yaml", check_handlers=False)
    deeper = "a: " + "[" * 100_000 + "]" * 100_000 + "\n"
    with pytest.raises(WorkflowValidationError, match="nested more than 64 levels"):
        parse_spec(deeper, "deeper.yaml", check_handlers=False)


def test_a_huge_file_is_refused_before_it_is_read(tmp_path):
    path = tmp_path / "huge.yaml"
    path.write_text("#" * (2 << 20))
    with pytest.raises(WorkflowValidationError, match="a workflow file may have at most 1048576"):
        validate_file(path)
