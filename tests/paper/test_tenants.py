"""Tenants of one workflow (replay/tenants.py): `traffic*3` expands to three deployments of their own."""

from __future__ import annotations

import pytest

from streambox.replay.run import ReplayConfig
from streambox.replay.systems import load_workflow
from streambox.replay.tenants import MAX_TENANTS, expand_tenants, tenant_of, tenant_spec_name


def test_a_count_expands_to_numbered_tenants_and_plain_names_stay() -> None:
    assert expand_tenants(["traffic*3", "social-media"]) == (
        "traffic@1",
        "traffic@2",
        "traffic@3",
        "social-media",
    )
    assert tenant_of("traffic@2") == ("traffic", 2)
    assert tenant_of("traffic") == ("traffic", None)
    assert tenant_spec_name("traffic", 2) == "traffic-u2"


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["traffic*0"], "within 1..48, got 0"),
        ([f"traffic*{MAX_TENANTS + 1}"], f"got {MAX_TENANTS + 1}"),
        (["traffic*2", "traffic@1"], "named more than once: traffic@1"),
        (["traffic*abc"], r"'traffic\*abc': NAME\*N takes a workflow name and a whole number of tenants"),
        (["*3"], r"'\*3': NAME\*N takes"),
    ],
)
def test_a_bad_count_or_a_repeated_tenant_is_refused(names: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        expand_tenants(names)


def test_the_replay_config_records_the_tenants_and_each_deploys_under_its_own_name() -> None:
    assert ReplayConfig(workflows=("traffic*2",)).workflows == ("traffic@1", "traffic@2")
    with pytest.raises(ValueError, match="workflows"):
        ReplayConfig(workflows=("traffic*0",))
    first, _ = load_workflow("traffic@1", small=True)
    second, make = load_workflow("traffic@2", small=True)
    plain, _ = load_workflow("traffic", small=True)
    assert (first.name, second.name) == ("traffic-u1", "traffic-u2")
    assert first.functions == plain.functions and first.edges == plain.edges
    assert "image" in make(0)
