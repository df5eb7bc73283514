"""Pool ablation modes: parsing and the mechanisms each one switches on."""

from __future__ import annotations

import pytest

from streambox.memory_pool.modes import PoolMode


def test_parse_accepts_the_values_case_insensitively() -> None:
    assert PoolMode.parse("static") is PoolMode.STATIC
    assert PoolMode.parse(" FM ") is PoolMode.FM
    assert PoolMode.parse("fm+rs") is PoolMode.FM_RS
    assert str(PoolMode.FM_RS) == "fm+rs"


def test_parse_error_lists_the_allowed_values() -> None:
    with pytest.raises(ValueError, match=r"unknown memory-pool mode 'rs'; allowed: 'static', 'fm', 'fm\+rs'"):
        PoolMode.parse("rs")


@pytest.mark.parametrize(
    ("mode", "lazy", "eager", "scaling"),
    [
        (PoolMode.STATIC, False, False, False),
        (PoolMode.FM, True, True, False),
        (PoolMode.FM_RS, True, True, True),
    ],
)
def test_mechanisms_per_mode(mode: PoolMode, lazy: bool, eager: bool, scaling: bool) -> None:
    assert (mode.lazy, mode.eager_recycling, mode.resilient_scaling) == (lazy, eager, scaling)
