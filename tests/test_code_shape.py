"""The house's size limits (issue 15's "done when"): no file under `api_proxy/` over 500 lines, and no
function or method under `api_proxy/`, `comm/` or `workflows/` over 60 lines. A failure names the file,
the function and its length, so the fix (split it into named steps) starts where it points."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = {"api_proxy": 500}
MAX_FUNCTION_LINES = 60
CHECKED = ("api_proxy", "comm", "workflows")


def _sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def long_functions(path: Path, limit: int, root: Path = ROOT) -> list[str]:
    """`file:line name (n lines)` for each function or method of `path` longer than `limit` lines
    (from its `def`, decorators excluded, to its last line)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > limit:
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({length} lines)")
    return found


@pytest.mark.parametrize("folder", CHECKED)
def test_no_function_over_the_limit(folder: str) -> None:
    too_long = [hit for path in _sources(folder) for hit in long_functions(path, MAX_FUNCTION_LINES)]
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: " + "; ".join(too_long)


@pytest.mark.parametrize("folder", sorted(MAX_FILE_LINES))
def test_no_file_over_the_limit(folder: str) -> None:
    limit = MAX_FILE_LINES[folder]
    sizes = {path: len(path.read_text().splitlines()) for path in _sources(folder)}
    too_big = [f"{path.relative_to(ROOT)} ({n} lines)" for path, n in sizes.items() if n > limit]
    assert not too_big, f"files under {folder}/ over {limit} lines: " + "; ".join(too_big)


def test_the_check_sees_a_long_function(tmp_path: Path) -> None:
    """The walker itself: a 61-line method is reported with its name and length, a 60-line function
    is not."""
    lines = [f"x{i} = {i}" for i in range(59)]
    short = ["def short():", *(f"    {line}" for line in lines)]
    long = ["class C:", "    def long(self):", *(f"        {line}" for line in lines), "        return 1"]
    source = tmp_path / "m.py"
    source.write_text("\n".join([*short, "", *long]) + "\n")
    assert long_functions(source, MAX_FUNCTION_LINES, root=tmp_path) == ["m.py:63 long (61 lines)"]
