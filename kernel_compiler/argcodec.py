"""JSON encoding of kernel arguments.

A kernel's arguments are stored as plain JSON values so that a plan is readable by any process without
pickle. Tensors are references to plan variables, ``{"var": name}``; torch enums and non-finite floats,
which JSON cannot spell, are tagged one-key objects; lists and tuples become lists; ``None``, bools,
ints, finite floats and strings are inline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

_LAYOUTS = {str(lay): lay for lay in (torch.strided, torch.sparse_coo, torch.sparse_csr, torch._mkldnn)}
_MEMORY_FORMATS = {
    str(mf): mf
    for mf in (torch.contiguous_format, torch.channels_last, torch.channels_last_3d, torch.preserve_format)
}


@dataclass(frozen=True)
class VarRef:
    """A decoded tensor argument: the name of the plan variable it reads."""

    name: str


@dataclass(frozen=True)
class DeviceArg:
    """A decoded device argument. The executor runs the kernel on the device its tensors live on, so the
    recorded device (the one used at export, always CPU) is only a fallback."""

    recorded: str


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def encode(value: Any, var_of: Any) -> Any:
    """Encode one argument; ``var_of(obj)`` returns the variable name for a tensor-valued graph node
    (or raises if ``obj`` is not one)."""
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, list | tuple):
        return [encode(v, var_of) for v in value]
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    if isinstance(value, torch.layout):
        return {"layout": str(value)}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    return {"var": var_of(value)}


def decode(value: Any) -> Any:
    """Decode one argument; tensor references become ``VarRef`` and devices ``DeviceArg``."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    ((tag, payload),) = value.items()
    if tag == "var":
        return VarRef(payload)
    if tag == "float":
        return float(payload)
    if tag == "dtype":
        return dtype_from_name(payload)
    if tag == "layout":
        return _LAYOUTS[payload]
    if tag == "memory_format":
        return _MEMORY_FORMATS[payload]
    if tag == "device":
        return DeviceArg(payload)
    raise ValueError(f"unknown argument tag {tag!r}")


def var_names(value: Any) -> list[str]:
    """Every variable an encoded argument references, in order."""
    if isinstance(value, list):
        return [n for v in value for n in var_names(v)]
    if isinstance(value, dict) and "var" in value:
        return [value["var"]]
    return []
