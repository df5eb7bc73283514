"""Command-line flags built from the settings tree (`streambox.config`), one spelling for all commands.

A field `pool_mode` is the flag `--pool-mode VALUE`; `serve`, `burst` and `replay` each call
`add_setting_flags` for the groups they take, and `given_settings(args, group)` returns the values
given (still strings, validated by the tree, as replay's `--set` values are). Building a parser
imports only pydantic and the tree: `streambox --help` loads no torch.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from streambox.config import (
    DEVICE_FIELDS,
    ENV_PREFIX,
    MECHANISM_FIELDS,
    RUN_FIELDS,
    Config,
    DeviceFields,
    Mechanisms,
    RunOptions,
)

#: The flag groups: (title, the model the fields belong to, the fields).
DEVICE = ("device (default: the environment, STREAMBOX_<FIELD>)", DeviceFields, DEVICE_FIELDS)
MECHANISMS = ("the paper's mechanisms (default: the --system's)", Mechanisms, MECHANISM_FIELDS)
RUN = ("run", RunOptions, RUN_FIELDS)
Group = tuple[str, type[BaseModel], tuple[str, ...]]


def flag_of(name: str) -> str:
    return "--" + name.replace("_", "-")


def _metavar(info: FieldInfo) -> str:
    """`a|b|c` for a choice, `on|off` for a switch, else N / X (an optional field: its type's)."""
    annotation = info.annotation
    inner = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(inner) == 1:
        annotation = inner[0]
    if typing.get_origin(annotation) is typing.Literal:
        return "|".join(map(str, typing.get_args(annotation)))
    if annotation is bool:
        return "on|off"
    return "N" if annotation is int else "X"


def add_setting_flags(parser: argparse.ArgumentParser, *groups: Group) -> None:
    """One flag per field of each group; every default None (unset: the environment, then the tree)."""
    for title, model, names in groups:
        group = parser.add_argument_group(title)
        for name in names:
            info = model.model_fields[name]
            env = f" [{ENV_PREFIX}{name.upper()}]" if model is DeviceFields else ""
            group.add_argument(
                flag_of(name),
                dest=name,
                default=None,
                metavar=_metavar(info),
                help=f"{info.description or name}{env}",
            )


def given_settings(args: argparse.Namespace, *groups: Group) -> dict[str, Any]:
    """The fields of `groups` given on the command line, as given."""
    return {
        name: getattr(args, name)
        for _, _, names in groups
        for name in names
        if getattr(args, name, None) is not None
    }


class DeprecatedAlias(argparse.Action):
    """A former flag kept for one release: sets `dest` to `const` and says what replaces it."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, const: Any, instead: str, **kw: Any):
        super().__init__(option_strings, dest, nargs=0, const=const, **kw)
        self.instead = instead

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, *_: Any) -> None:
        print(
            f"{parser.prog}: {'/'.join(self.option_strings)} is deprecated; use {self.instead}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, self.const)


def add_deprecated_alias(parser: argparse.ArgumentParser, flag: str, dest: str, value: Any) -> None:
    """`flag` (no value) stands for `--<dest> <value>` for one release, printing a line when used."""
    parser.add_argument(
        flag,
        dest=dest,
        action=DeprecatedAlias,
        const=value,
        instead=f"{flag_of(dest)} {value}",
        help=f"deprecated: {flag_of(dest)} {value}",
    )


__all__ = [
    "DEVICE",
    "MECHANISMS",
    "RUN",
    "add_deprecated_alias",
    "add_setting_flags",
    "config_from",
    "flag_of",
    "given_settings",
]


def config_from(args: argparse.Namespace, **defaults: Any) -> Config:
    """The device configuration: the environment's (`defaults`, a command's own, where it sets
    nothing), with the device flags given over it."""
    return Config.from_env(**defaults).with_overrides(**given_settings(args, DEVICE))
