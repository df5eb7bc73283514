"""Loading a workflow YAML file strictly, with errors that name the file, the line and the field.

The YAML is composed into nodes (PyYAML's compose API), which keep their position; the data built from
them is validated by the pydantic models of `spec.py`, and every error's location (a path of keys and
indices) is mapped back to the line of that key. Then the graph (cycles, joins, unknown functions),
the handlers (the workflow's own code, importable, callable with `(ctx, event)`: `handler_check.py`,
in a child process) and the models (in the zoo) are checked. All
mistakes are reported at once, one line each::

    traffic.yaml:7:5: functions.detect.batchsize: unknown key; did you mean 'batch_size'? ...
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from yaml.constructor import SafeConstructor
from yaml.error import Mark
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from streambox.api_proxy.function_spec import HANDLER_PATTERN
from streambox.kernel_compiler.model_pool import unknown_model

from .handler_check import check_target, inspect_handlers
from .handlers import HandlerError
from .spec import NAME_PATTERN, EdgeSpec, FunctionSpec, WorkflowSpec, check_graph

Loc = tuple[str | int, ...]

#: Bounds of a workflow document: values built (aliases count once per use, so an alias bomb stops
#: here instead of expanding), alias uses, and the nesting depth. Real workflows are far below them.
MAX_NODES = 10_000
MAX_ALIAS_USES = 200
MAX_DEPTH = 64
MAX_FILE_BYTES = 1 << 20


class _TooLarge(Exception):
    """The document passed one of the bounds above; the message says which."""

    def __init__(self, message: str, mark: Mark) -> None:
        super().__init__(message)
        self.mark = mark


@dataclass(frozen=True)
class Issue:
    """One mistake in a workflow file."""

    file: str
    line: int | None  # 1-based
    column: int | None  # 1-based
    field: str  # dotted path of the key, e.g. functions.detect.models[0]; "" for the whole document
    message: str

    def __str__(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}:{self.column}"
        return f"{where}: {self.field}: {self.message}" if self.field else f"{where}: {self.message}"


class WorkflowValidationError(ValueError):
    """A workflow file with mistakes; `str()` is the user-facing message (one line per issue, in the
    order of the file)."""

    def __init__(self, issues: list[Issue]) -> None:
        issues = sorted(issues, key=lambda i: (i.line or 0, i.column or 0))
        super().__init__("\n".join(str(i) for i in issues))
        self.issues = issues

    def __str__(self) -> str:
        return "\n".join(str(i) for i in self.issues)


def format_loc(loc: Iterable[str | int]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


_YAML_TAG = "tag:yaml.org,2002:"
_MERGE_TAG = _YAML_TAG + "merge"
_INVALID = object()  # a scalar its tag refuses (said as an issue)
_PLAIN_KINDS = frozenset(
    ("map", "seq", "str", "int", "float", "bool", "null", "timestamp", "binary", "merge", "value")
)


def _plain_tag(tag: str) -> bool:
    """A tag the safe loader resolves to plain data (what a YAML file gets without writing a tag)."""
    return tag.startswith(_YAML_TAG) and tag[len(_YAML_TAG) :] in _PLAIN_KINDS


class _CoreLoader(yaml.SafeLoader):
    """YAML 1.2's core schema for plain scalars, not PyYAML's 1.1: `yes`, `on`, `010` (octal 8), `1:30`
    (sexagesimal 90), `1_000` and dates stay text, which a typed field then refuses by name, and
    `2e2` is a number. true/false, null/~, decimal and 0x/0o integers, floats with .inf and .nan."""

    yaml_implicit_resolvers: dict = {}  # noqa: RUF012 - PyYAML's class-level table, this loader's own


for _tag, _pattern, _first in (
    ("bool", r"^(?:true|True|TRUE|false|False|FALSE)$", "tTfF"),
    ("null", r"^(?:~|null|Null|NULL|)$", ["~", "n", "N", ""]),
    ("int", r"^(?:[-+]?(?:0|[1-9][0-9]*)|0x[0-9a-fA-F]+|0o[0-7]+)$", "-+0123456789"),
    ("float", r"^(?:[-+]?(?:\.[0-9]+|[0-9]+\.[0-9]*)(?:[eE][-+]?[0-9]+)?|[-+]?[0-9]+[eE][-+]?[0-9]+"
              r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$", "-+.0123456789"),
    ("merge", r"^(?:<<)$", "<"),
):
    _CoreLoader.add_implicit_resolver(f"{_YAML_TAG}{_tag}", re.compile(_pattern), list(_first))


_YAML11 = yaml.SafeLoader("")  # its resolver: what PyYAML's YAML 1.1 made of a plain value


class _Document:
    """YAML nodes turned into plain data, remembering where each key and item stands."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.marks: dict[Loc, Mark] = {}
        self.issues: list[Issue] = []
        self._constructor = SafeConstructor()
        self._built = 0
        self._seen: set[int] = set()
        self._alias_uses = 0
        self._merged: dict[int, int] = {}  # per mapping node: how many of its pairs were merged in

    def issue(self, loc: Loc, message: str, mark: Mark | None = None) -> None:
        mark = mark or self.mark_for(loc)
        line = mark.line + 1 if mark else None
        column = mark.column + 1 if mark else None
        self.issues.append(Issue(self.file, line, column, format_loc(loc), message))

    def mark_for(self, loc: Loc) -> Mark | None:
        """The mark of `loc`, or of its nearest enclosing key that exists in the file."""
        loc = tuple(p for p in loc if p != "[key]")
        for n in range(len(loc), -1, -1):
            if loc[:n] in self.marks:
                return self.marks[loc[:n]]
        return None

    def build(self, node: Node, loc: Loc = (), active: frozenset[int] = frozenset()) -> Any:
        if id(node) in active:
            self.issue(loc, "recursive YAML alias", node.start_mark)
            return None
        self._count(node, len(active))
        active = active | {id(node)}
        if not _plain_tag(node.tag):  # `!!python/object/apply:...` and the like: never constructed
            shown = "!!" + node.tag.removeprefix(_YAML_TAG) if node.tag.startswith(_YAML_TAG) else node.tag
            plain = "a workflow holds plain values (text, numbers, lists, mappings)"
            self.issue(loc, f"unsupported YAML tag {shown}: {plain}", node.start_mark)
            return None
        if isinstance(node, MappingNode):
            if id(node) not in self._merged:  # flattened in place once: an alias reaches it flattened
                own = sum(key.tag != _MERGE_TAG for key, _ in node.value)
                self._constructor.flatten_mapping(node)  # merge keys (<<) as PyYAML does: merged pairs
                self._merged[id(node)] = len(node.value) - own  # first, a key of its own overrides them
            merged = self._merged[id(node)]
            out: dict[Any, Any] = {}
            from_merge: set[str] = set()
            for i, (key_node, value_node) in enumerate(node.value):
                if not isinstance(key_node, ScalarNode):
                    self.issue(loc, "a key must be a plain value, not a list or mapping", key_node.start_mark)
                    continue
                key = self._scalar(key_node, loc)
                if key is _INVALID:  # not a value of its tag: said
                    continue
                if not isinstance(key, str):  # YAML reads 1, true, null as such: 1 and true collide
                    text = key_node.value
                    message = f"a key must be text, not {type(key).__name__} {key!r}: quote it ('{text}')"
                    self.issue((*loc, text), message, key_node.start_mark)
                    continue
                if key in out and key not in from_merge:
                    self.issue((*loc, key), "duplicate key", key_node.start_mark)
                    continue
                (from_merge.add if i < merged else from_merge.discard)(key)
                self.marks[(*loc, key)] = key_node.start_mark
                out[key] = self.build(value_node, (*loc, key), active)
            return out
        if isinstance(node, SequenceNode):
            items = []
            for i, item in enumerate(node.value):
                self.marks[(*loc, i)] = item.start_mark
                items.append(self.build(item, (*loc, i), active))
            return items
        value = self._scalar(node, loc)
        return None if value is _INVALID else value

    def _scalar(self, node: Node, loc: Loc) -> Any:
        """A scalar's value; `_INVALID`, with an issue, where its tag refuses it (`!!int abc`) or where
        YAML 1.1 read a plain value as a boolean or number that YAML 1.2 reads as text (`no`, `off`,
        `010`, `1_000`): silently text in free-form params, it would invert a handler's `if`."""
        if node.style is None and node.tag == _YAML_TAG + "str":
            was = _YAML11.resolve(ScalarNode, node.value, (True, False)).removeprefix(_YAML_TAG)
            if was in ("bool", "int", "float"):
                what = "true or false" if was == "bool" else "it in decimal (1000, 8.5)"
                was = f"an {was}" if was == "int" else f"a {was}"
                text = f"{node.value!r} is text in YAML 1.2 (YAML 1.1 read it as {was})"
                write = f"write {what}, or quote it ('{node.value}') for text"
                self.issue(loc, f"{text}: {write}", node.start_mark)
                return _INVALID
        try:
            return self._constructor.construct_object(node)
        except Exception:  # noqa: BLE001 - the constructors raise anything (AttributeError too) for it
            shown = "!!" + node.tag.removeprefix(_YAML_TAG) if node.tag.startswith(_YAML_TAG) else node.tag
            self.issue(loc, f"{node.value!r} is not a valid {shown}", node.start_mark)
            return _INVALID


    def _count(self, node: Node, depth: int) -> None:
        self._built += 1
        if id(node) in self._seen:  # composed once, reached again: an alias
            self._alias_uses += 1
        else:
            self._seen.add(id(node))
        if self._built > MAX_NODES:
            raise _TooLarge(
                f"the document expands to more than {MAX_NODES} values "
                f"({self._alias_uses} uses of YAML aliases so far); a workflow needs far fewer",
                node.start_mark,
            )
        if self._alias_uses > MAX_ALIAS_USES:
            raise _TooLarge(f"more than {MAX_ALIAS_USES} uses of YAML aliases", node.start_mark)
        if depth > MAX_DEPTH:
            raise _TooLarge(f"values nested more than {MAX_DEPTH} levels deep", node.start_mark)


def _model_at(loc: Loc) -> type[BaseModel] | None:
    if len(loc) == 0:
        return WorkflowSpec
    if len(loc) == 2 and loc[0] == "functions":
        return FunctionSpec
    if len(loc) == 2 and loc[0] == "edges":
        return EdgeSpec
    return None


def _keys_of(model: type[BaseModel]) -> list[str]:
    return [f.alias or name for name, f in model.model_fields.items()]


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_PATTERNS = {
    NAME_PATTERN: "a valid name: lowercase letters, digits, '-' and '_', starting with a letter or digit",
    HANDLER_PATTERN: "a handler reference of the form module:function (e.g. my_handlers:detect)",
}


def _pydantic_issues(doc: _Document, error: ValidationError) -> None:
    for err in error.errors():
        loc: Loc = tuple(err["loc"])
        kind = err["type"]
        if kind == "extra_forbidden":
            model = _model_at(loc[:-1])
            allowed = _keys_of(model) if model else []
            hint = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            message = "unknown key" + (f"; did you mean {hint[0]!r}?" if hint else "")
            if allowed:
                message += f" (allowed keys: {', '.join(allowed)})"
            doc.issue(loc, message)
        elif kind == "missing":
            doc.issue(loc, "required key is missing")
        elif kind == "string_pattern_mismatch" and err.get("ctx", {}).get("pattern") in _PATTERNS:
            what = _PATTERNS[err["ctx"]["pattern"]]
            doc.issue(tuple(p for p in loc if p != "[key]"), f"{err['input']!r} is not {what}")
        else:
            doc.issue(loc, f"{err['msg']} (got {_short(err['input'])})")


def _check_edges(doc: _Document, spec: WorkflowSpec) -> None:
    """A bound that bounds nothing is a slip, as batching's half-settings are."""
    for i, edge in enumerate(spec.edges):
        if "max_items" in edge.model_fields_set and not edge.fan_out:
            doc.issue(("edges", i, "max_items"), "bounds the items of a fan_out edge; this edge does not fan "
                      "out (fan_out: true), so it would do nothing")


def _check_functions(doc: _Document, spec: WorkflowSpec, check_handlers: bool) -> WorkflowSpec:
    declared_by = _check_handlers(doc, spec) if check_handlers else {}
    filled: dict[str, FunctionSpec] = {}
    for name, fn in spec.functions.items():
        _check_batching(doc, name, fn, spec.timeout_ms)
        for i, model in enumerate(fn.models):
            if problem := unknown_model(model):  # neither the zoo's nor registered in the model pool
                doc.issue(("functions", name, "models", i), problem)
            elif model in fn.models[:i]:
                doc.issue(("functions", name, "models", i), f"model {model!r} is listed twice")
        declared = declared_by.get(name)
        if declared is None:
            continue
        if not fn.models:
            for model in declared:
                if problem := unknown_model(model):
                    doc.issue(("functions", name, "handler"), f"the handler declares {problem}")
            filled[name] = fn.model_copy(update={"models": declared})
        elif set(declared) != set(fn.models):
            doc.issue(
                ("functions", name, "models"),
                f"the handler declares models {declared} but the workflow lists {fn.models}",
            )
    if not filled:
        return spec
    functions = {name: filled.get(name, fn) for name, fn in spec.functions.items()}
    return spec.model_copy(update={"functions": functions}).with_base_dir(spec.base_dir)


def _check_batching(doc: _Document, name: str, fn: FunctionSpec, workflow_timeout_ms: float) -> None:
    """The batcher's settings against the function's batch size and time limit."""
    if 1 < fn.max_batch_size < fn.batch_size:
        doc.issue(
            ("functions", name, "max_batch_size"),
            f"{fn.max_batch_size} is smaller than batch_size ({fn.batch_size}): a batch holds whole "
            f"invocations' inputs, so it must be 1 (no batching) or at least {fn.batch_size}",
        )
    elif 1 < fn.max_batch_size < 2 * fn.batch_size:
        doc.issue(
            ("functions", name, "max_batch_size"),
            f"{fn.max_batch_size} is less than two invocations' samples ({2 * fn.batch_size}, "
            f"batch_size {fn.batch_size} each): no batch would ever hold more than one; set 1 (no "
            f"batching) or at least {2 * fn.batch_size}",
        )
    else:
        _check_batching_is_on(doc, name, fn)
    # The request's timeout bounds every invocation in it, whatever the function's own says.
    limit_ms = workflow_timeout_ms if fn.timeout_ms is None else min(fn.timeout_ms, workflow_timeout_ms)
    if fn.max_batch_size > 1 and fn.max_queue_delay_ms >= limit_ms:
        which = "the workflow's timeout_ms" if limit_ms == workflow_timeout_ms else "its timeout_ms"
        doc.issue(
            ("functions", name, "max_queue_delay_ms"),
            f"{fn.max_queue_delay_ms:g} ms is not shorter than the invocation's time limit "
            f"({limit_ms:g} ms, {which}): a call no other joins would time out waiting for its batch",
        )


def _check_batching_is_on(doc: _Document, name: str, fn: FunctionSpec) -> None:
    """Batching needs both settings: one without the other is a slip that would leave every call
    unbatched without a word (docs/workflows.md, "Batching"). (`max_instances` 1 is not one: the
    per-instance systems send a batch to one instance, and the proxy runs such a function's calls at
    once, as no other could be waiting to join them.)"""
    if fn.max_batch_size > 1 and fn.max_queue_delay_ms == 0:
        doc.issue(
            ("functions", name, "max_batch_size"),
            f"{fn.max_batch_size} needs max_queue_delay_ms > 0 too (how long a batch waits for more "
            "calls): with 0 every call runs alone; set both, or max_batch_size: 1",
        )
    elif fn.max_batch_size == 1 and fn.max_queue_delay_ms > 0:
        doc.issue(
            ("functions", name, "max_queue_delay_ms"),
            f"{fn.max_queue_delay_ms:g} ms has no effect without max_batch_size > 1 (batching is off); "
            "set max_batch_size, or leave max_queue_delay_ms out",
        )


def _check_handlers(doc: _Document, spec: WorkflowSpec) -> dict[str, list[str] | None]:
    """The models each usable handler declares; an issue for every other one. Handlers must be the
    workflow's own code, and are imported in a child process, never in this one."""
    refs: dict[str, str] = {}
    for name, fn in spec.functions.items():
        try:
            check_target(fn.handler, spec.base_dir)
            refs[name] = fn.handler
        except HandlerError as error:
            doc.issue(("functions", name, "handler"), str(error))
    declared: dict[str, list[str] | None] = {}
    for name, outcome in (inspect_handlers(refs, spec.base_dir) if refs else {}).items():
        if isinstance(outcome, HandlerError):
            doc.issue(("functions", name, "handler"), str(outcome))
        else:
            declared[name] = outcome
    return declared


def parse_spec(
    text: str,
    file: str = "<string>",
    base_dir: Path | None = None,
    *,
    check_handlers: bool = True,
) -> WorkflowSpec:
    """Validate YAML text; raises `WorkflowValidationError` listing every mistake."""
    doc = _Document(file)
    try:
        root = yaml.compose(text, Loader=_CoreLoader)
        if root is not None:
            doc.marks[()] = root.start_mark
        data = doc.build(root) if root is not None else None
    except _TooLarge as error:
        doc.issue((), str(error), error.mark)
        raise WorkflowValidationError(doc.issues) from None
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        problem = "; ".join(p for p in (error.context, error.problem) if p)
        doc.issue((), f"invalid YAML: {problem}", mark)
        raise WorkflowValidationError(doc.issues) from None
    except yaml.reader.ReaderError as error:  # a character YAML refuses: placed by line, not offset
        offset = error.position
        line, column = text.count("\n", 0, offset), offset - (text.rfind("\n", 0, offset) + 1)
        mark = yaml.Mark(file, offset, line, column, None, None)
        char = error.character
        shown = f"U+{char:04X}" if isinstance(char, int) else repr(char)
        doc.issue((), f"invalid YAML: character {shown} is not allowed ({error.reason})", mark)
        raise WorkflowValidationError(doc.issues) from None
    except yaml.YAMLError as error:
        doc.issue((), f"invalid YAML: {error}")
        raise WorkflowValidationError(doc.issues) from None
    except RecursionError:  # the composer recurses per level, before `build` can count
        doc.issue((), f"values nested more than {MAX_DEPTH} levels deep")
        raise WorkflowValidationError(doc.issues) from None
    if not isinstance(data, dict) and not doc.issues:  # a refused tag at the top said why already
        keys = ", ".join(_keys_of(WorkflowSpec))
        found = "an empty file" if data is None else f"a {type(data).__name__}"
        doc.issue((), f"a workflow is a YAML mapping with the keys {keys}; found {found}")
    if doc.issues:
        raise WorkflowValidationError(doc.issues)
    try:
        spec = WorkflowSpec.model_validate(data).with_base_dir(base_dir)
    except ValidationError as error:
        _pydantic_issues(doc, error)
        raise WorkflowValidationError(doc.issues) from None
    for loc, message in check_graph(spec):
        doc.issue(loc, message)
    _check_edges(doc, spec)
    spec = _check_functions(doc, spec, check_handlers)
    if doc.issues:
        raise WorkflowValidationError(doc.issues)
    return spec


def validate_file(path: str | Path, *, check_handlers: bool = True) -> WorkflowSpec:
    """Load and validate a workflow YAML file (the CLI's `streambox validate`)."""
    path = Path(path)
    try:
        with path.open("rb") as file:  # read to the limit, not the size it claims (a pipe, /dev/zero)
            data = file.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            message = f"more than {MAX_FILE_BYTES} bytes; a workflow file may have at most {MAX_FILE_BYTES}"
            raise WorkflowValidationError([Issue(str(path), None, None, "", message)])
        text = data.decode("utf-8")
    except OSError as error:
        raise WorkflowValidationError(
            [Issue(str(path), None, None, "", error.strerror or str(error))]
        ) from None
    except UnicodeDecodeError:
        raise WorkflowValidationError([Issue(str(path), None, None, "", "not a UTF-8 text file")]) from None
    return parse_spec(text, str(path), path.resolve().parent, check_handlers=check_handlers)
