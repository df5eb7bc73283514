"""The settings tree's machinery: frozen pydantic nodes whose mistakes are `SettingsError`s (one line
per mistake, naming the field, the value and what is allowed), environment defaults, the libraries'
dataclasses validated from a group of values, and the names of string options. The nodes themselves
are in `streambox.config`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError

ENV_PREFIX = "STREAMBOX_"
SWITCH_WORDS = "on or off (true/false, yes/no, 1/0)"

M = TypeVar("M", bound=BaseModel)
D = TypeVar("D")


class SettingsError(ValueError):
    """Settings that do not validate; one line per mistake, each naming field, value and allowed."""


def _allowed(error: Mapping[str, Any]) -> str:
    """What a pydantic error says is allowed, in the words of the command line."""
    kind, ctx = error["type"], error.get("ctx") or {}
    if kind == "literal_error":
        return "is not one of " + str(ctx.get("expected", "")).replace("'", "").replace(" or ", ", ")
    if kind == "bool_parsing" or kind == "bool_type":
        return f"is not {SWITCH_WORDS}"
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return "is not an integer"
    if kind in ("float_parsing", "float_type"):
        return "is not a number"
    if kind == "extra_forbidden":
        return "is not a known setting"
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
    if kind in bounds:
        limit = next(iter(ctx.values()), "")
        return f"must be {bounds[kind]} {limit}"
    return str(error["msg"]).removeprefix("Value error, ")


def settings_error(error: ValidationError, *, where: str = "") -> SettingsError:
    """A pydantic `ValidationError` as one line per mistake: `[where: ]field 'value' is not ...`."""
    lines = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"])
        value = item.get("input")
        shown = f"{field} {value!r} " if field and item["type"] != "missing" else f"{field} " if field else ""
        lines.append(f"{where + ': ' if where else ''}{shown}{_allowed(item)}")
    return SettingsError("\n".join(lines))


def build(model: type[M], where: str = "", **values: Any) -> M:
    """`model(**values)`; a mistake raises `SettingsError` naming `where` (default: the model)."""
    try:
        return model(**values)
    except SettingsError as error:
        if not where:
            raise
        prefix = f"{model.__name__}: "
        lines = (line.removeprefix(prefix) for line in str(error).splitlines())
        raise SettingsError("\n".join(f"{where}: {line}" for line in lines)) from None


def env_factory(*names: str, default: Any = None) -> Callable[[], Any]:
    """A default factory: the first `STREAMBOX_<NAME>` set in the environment (validated like any
    value), else `default`; so a switch set in the environment reaches every record built here."""

    def factory() -> Any:
        environ = {key.upper(): value for key, value in os.environ.items()}  # as `Settings` reads it
        for name in names:
            value = environ.get(f"{ENV_PREFIX}{name.upper()}")
            if value is not None:
                return value
        return default

    return factory


def env_group(group: str) -> Callable[[], dict[str, Any]]:
    """A default factory: the `STREAMBOX_<GROUP>__<FIELD>` variables of the environment as a mapping;
    a further `__` nests (`STREAMBOX_STORE__QUOTA__WRITER_SHARE` is the store's `quota.writer_share`)."""

    def factory() -> dict[str, Any]:
        prefix = f"{ENV_PREFIX}{group.upper()}__"
        values: dict[str, Any] = {}
        for key, value in os.environ.items():
            if key.upper().startswith(prefix):
                *parents, name = key[len(prefix) :].lower().split("__")
                node = values
                for parent in parents:
                    node = node.setdefault(parent, {})
                    if not isinstance(node, dict):  # `QUOTA` and `QUOTA__X` both set: the mistake is named
                        raise SettingsError(f"{key}: {group}.{parent} is set as a whole and by its fields")
                if isinstance(node.get(name), dict):
                    raise SettingsError(f"{key}: {group}.{name} is set as a whole and by its fields")
                node[name] = value
        return values

    return factory


def library_config(
    kind: type[D], values: Mapping[str, Any], group: str, reserved: Mapping[str, str] = {}
) -> D:
    """The library's own dataclass (`PoolConfig`, `StoreConfig`, ...) from a group of the tree, its
    values validated and converted by pydantic against the dataclass's annotations; a mistake names
    `group.field`, the value and what is allowed; `reserved` fields are set elsewhere (by a switch)."""
    known = [f.name for f in dataclasses.fields(kind)]  # type: ignore[arg-type]
    reserved = reserved or {}
    for name in values:
        if name in reserved:
            raise SettingsError(f"{group}.{name}: set by {reserved[name]}, not in this group")
        if name not in known:
            allowed = ", ".join(n for n in known if n not in reserved)
            raise SettingsError(f"{group}.{name} is not a setting of {kind.__name__}; known: {allowed}")
    try:
        return TypeAdapter(kind).validate_python(dict(values))
    except ValidationError as error:
        raise settings_error(error, where=group) from None


def words(value: Any) -> Any:
    """Choices and switches ignore case and surrounding spaces."""
    return value.strip().lower() if isinstance(value, str) else value


class SettingsModel(BaseModel):
    """A frozen node of the tree: unknown fields refused, mistakes raised as `SettingsError`."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as error:
            raise settings_error(error, where=type(self).__name__) from None


# ============================================================================================ device
def option_name(key: str) -> str:
    """`Pool-Mode` -> `pool_mode`: keys of `--set` and of string options ignore case and take `-`."""
    return str(key).strip().lower().replace("-", "_")


def check_keys(given: Mapping[str, Any], known: tuple[str, ...], what: str) -> None:
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise SettingsError(f"unknown {what} {', '.join(map(repr, unknown))}; known: {', '.join(known)}")
