"""More ranks (re-placed or added) are planned around the nodes still alive, never a dead master or allowlisted one."""

from __future__ import annotations

import pytest

from raydp.actors.slots import _alive_allowlist, _alive_master
from raydp.errors import PlacementError
from raydp.placement.inventory import Inventory, NodeInfo
from raydp.placement.planner import plan_placement

ALIVE = Inventory(
    (
        NodeInfo("aaaa1111", "10.0.0.1", is_head=True, total=4, available=2),
        NodeInfo("bbbb2222", "10.0.0.2", total=4, available=4),
    )
)


def test_a_dead_master_falls_back_to_the_head() -> None:
    assert _alive_master(ALIVE, "bbbb2222") == "bbbb2222"
    assert _alive_master(ALIVE, "dead9999") is None
    plan = plan_placement(ALIVE, dp_size=1, world_size=2, master_node_id=_alive_master(ALIVE, "dead9999"))
    assert len(plan.ranks) == 1


def test_a_dead_allowlisted_node_is_dropped_and_the_rest_kept() -> None:
    assert _alive_allowlist(ALIVE, None) is None
    assert _alive_allowlist(ALIVE, ("dead9999", "bbbb")) == ["bbbb"]
    plan = plan_placement(ALIVE, dp_size=1, world_size=4, node_allowlist=_alive_allowlist(ALIVE, ("dead9999", "bbbb")))
    assert [r.node_id for r in plan.ranks] == ["bbbb2222"]
    with pytest.raises(PlacementError, match="no allowlisted node is alive"):
        _alive_allowlist(ALIVE, ("dead9999",))
