"""Several users (tenants) of one workflow on one GPU (the paper's Fig. 19): `traffic*3` in a replay's
workflow list stands for three tenants `traffic@1`, `traffic@2`, `traffic@3`. Each tenant is deployed
as a workflow of its own (its spec renamed `traffic-u1`, ...), so the proxy systems give it its own API
proxy and the per-instance systems its own function instances; the trace's functions are spread over
the tenants like over any workflows (`--mapping`).

Pure: names in, names out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["MAX_TENANTS", "expand_tenants", "tenant_of", "tenant_spec_name"]

#: The most tenants one name may ask for (the paper's largest is 6; each is a deployment of its own).
MAX_TENANTS = 48

_MANY = re.compile(r"^(?P<base>.+)\*(?P<count>\d+)$")
_ONE = re.compile(r"^(?P<base>.+)@(?P<index>[1-9]\d*)$")


def expand_tenants(names: Iterable[str]) -> tuple[str, ...]:
    """`traffic*3` -> `traffic@1`, `traffic@2`, `traffic@3`; other names as they are. Raises ValueError
    for a count outside 1..MAX_TENANTS or a name given twice."""
    expanded: list[str] = []
    for name in names:
        many = _MANY.match(name)
        if many is None:
            if "*" in name:  # `traffic*abc`, `traffic*`, `*3`
                raise ValueError(
                    f"workflow {name!r}: NAME*N takes a workflow name and a whole number of tenants"
                )
            expanded.append(name)
            continue
        count = int(many["count"])
        if not 1 <= count <= MAX_TENANTS:
            raise ValueError(
                f"workflow {name!r}: the tenant count must be within 1..{MAX_TENANTS}, got {count}"
            )
        expanded += [f"{many['base']}@{i}" for i in range(1, count + 1)]
    repeated = sorted({n for n in expanded if expanded.count(n) > 1})
    if repeated:
        raise ValueError(f"workflows named more than once: {', '.join(repeated)}")
    return tuple(expanded)


def tenant_of(name: str) -> tuple[str, int | None]:
    """(`traffic`, 2) for the tenant `traffic@2`; (name, None) for a plain workflow."""
    one = _ONE.match(name)
    return (one["base"], int(one["index"])) if one else (name, None)


def tenant_spec_name(spec_name: str, tenant: int) -> str:
    """The deployed workflow name of a tenant: `traffic-u2` (the spec's name pattern has no `@`)."""
    return f"{spec_name}-u{tenant}"
