"""Placement on a real local Ray cluster: 3 nodes of 4, 4 and 2 logical GPUs sharing one IP.

No Ray mocks: inventory, plans, placement groups and the ``raydp plan`` command
run against ``ray.cluster_utils.Cluster`` nodes, which all share one IP, so
these tests also check that nodes are told apart by node id.

Group states are read from the GCS (``placement_group_table``), not through
``ray.util.state``: that API goes through the dashboard, which does not start
when another Ray cluster on the same host already holds the dashboard port.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from ray.cluster_utils import Cluster
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table

from raydp.cli import plan as cli_plan
from raydp.errors import ConfigError, PlacementError, PlacementTimeoutError
from raydp.placement import (
    Inventory,
    create_groups,
    plan_placement,
    read_inventory,
    remove_groups,
    validate_user_groups,
    wait_ready,
)
from raydp.placement.groups import NODE_ID_LABEL
from tests.integration.conftest import ClusterPool
from tests.integration.helpers import wait_until

pytestmark = pytest.mark.timeout(180)
SHAPE = (4, 4, 2)


@pytest.fixture(scope="module")
def cluster(cluster_pool: ClusterPool) -> Iterator[Cluster]:
    """A fresh 4/4/2-GPU cluster (2 CPUs per node) for this module, shut down after it."""
    yield cluster_pool.get(SHAPE, fresh=True, cpus_per_node=2)
    cluster_pool.shutdown()


@pytest.fixture
def inventory(cluster: Cluster) -> Inventory:
    """The idle cluster's inventory (resources of earlier tests' groups are released lazily)."""
    wait_for(lambda: idle(read_inventory("GPU")))
    return read_inventory("GPU")


def wait_for(check: Callable[[], bool], timeout_s: float = 15.0) -> None:
    if not wait_until(check, timeout_s):
        raise AssertionError(f"condition not met within {timeout_s}s")


def group_states(prefix: str) -> dict[str, str]:
    """name -> state of every group (removed ones included) whose name starts with prefix-."""
    table = placement_group_table().values()
    return {t["name"]: t["state"] for t in table if t["name"].startswith(prefix + "-")}


def is_detached(group: PlacementGroup) -> bool:
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    raw = state._connect_and_get_accessor().get_placement_group_info(group.id)
    return bool(gcs_pb2.PlacementGroupTableData.FromString(raw).is_detached)


def all_removed(prefix: str) -> bool:
    states = group_states(prefix)
    return bool(states) and set(states.values()) == {"REMOVED"}


def idle(inv: Inventory) -> bool:
    return all(n.free == n.devices for n in inv.nodes)


def test_inventory_tells_shared_ip_nodes_apart(inventory: Inventory) -> None:
    assert sorted(n.devices for n in inventory.nodes) == [2, 4, 4]
    assert len({n.ip for n in inventory.nodes}) == 1
    assert len({n.node_id for n in inventory.nodes}) == 3
    head = inventory.head
    assert head is not None and head.devices == 4 and inventory.nodes[0] is head
    assert all(n.free_cpus == 2 for n in inventory.nodes)
    assert all(n.labels.get(NODE_ID_LABEL) == n.node_id for n in inventory.nodes)


def test_fill_groups_land_on_planned_nodes_and_are_removed(inventory: Inventory) -> None:
    plan = plan_placement(inventory, dp_size=5, world_size=2, strategy="fill")
    worker4 = next(n.node_id for n in inventory.nodes if not n.is_head and n.devices == 4)
    worker2 = next(n.node_id for n in inventory.nodes if n.devices == 2)
    head = inventory.nodes[0].node_id
    assert [r.node_id for r in plan.ranks] == [head, head, worker4, worker4, worker2]
    groups = create_groups(plan, "plt-fill")
    try:
        wait_ready(groups, 30, plan=plan)
        for r, g in zip(plan.ranks, groups, strict=True):
            table = placement_group_table(g)
            assert table["name"] == f"plt-fill-dp{r.rank}"
            assert table["strategy"] == "STRICT_PACK" and table["state"] == "CREATED"
            assert set(table["bundles_to_node_id"].values()) == {r.node_id}
            assert list(table["bundles"].values()) == [{"GPU": 1.0}, {"GPU": 1.0}, {"CPU": 1.0}]
        # Ray's view of available resources trails the groups' CREATED state by a heartbeat.
        wait_for(lambda: [n.free for n in read_inventory("GPU").nodes] == [0, 0, 0])
    finally:
        remove_groups(groups)
    wait_for(lambda: all_removed("plt-fill"))
    assert set(group_states("plt-fill")) == {f"plt-fill-dp{i}" for i in range(5)}
    wait_for(lambda: idle(read_inventory("GPU")))
    remove_groups(groups)  # removing twice is fine


def test_span_rank_is_pinned_bundle_by_bundle(inventory: Inventory) -> None:
    plan = plan_placement(inventory, dp_size=1, world_size=8, strategy="span")
    assert plan.bundle_strategy == "PACK" and len(plan.ranks[0].node_ids) == 2
    groups = create_groups(plan, "plt-span")
    try:
        wait_ready(groups, 30, plan=plan)
        placed = placement_group_table(groups[0])["bundles_to_node_id"]
        assert tuple(placed[i] for i in sorted(placed)) == plan.bundle_node_ids(0)
    finally:
        remove_groups(groups)
    wait_for(lambda: all_removed("plt-span"))


def test_stale_plan_times_out_naming_groups_and_capacity(inventory: Inventory) -> None:
    plan = plan_placement(
        inventory,
        dp_size=2,
        world_size=2,
        strategy="strict",
        node_allowlist=[n.node_id for n in inventory.nodes if not n.is_head and n.devices == 4],
    )
    target = plan.ranks[0].node_id
    # Someone else takes the planned node's GPUs between planning and placing.
    blocker = placement_group(
        [{"GPU": 4.0}], strategy="STRICT_PACK", name="plt-blocker", bundle_label_selector=[{NODE_ID_LABEL: target}]
    )
    groups: list[PlacementGroup] = []
    try:
        assert blocker.wait(30)
        groups = create_groups(plan, "plt-stale")
        start = time.monotonic()
        with pytest.raises(PlacementTimeoutError) as info:
            wait_ready(groups, 3.0)  # no plan given: targets come from create_groups
        assert time.monotonic() - start < 30  # the 3 s timeout, not forever
        msg = str(info.value)
        short = inventory.short(target)
        assert "2 of 2 placement groups not ready after 3s" in msg
        for rank in (0, 1):
            row = next(line for line in msg.splitlines() if f"plt-stale-dp{rank}" in line)
            assert "PENDING" in row and "2x{GPU: 1} + {CPU: 1}" in row and target[:8] in row
        assert "node capacity now:" in msg
        for n in inventory.nodes:
            assert inventory.short(n.node_id) in msg
        assert any(short in line and "0/4" in line for line in msg.splitlines())
        # wait_ready removes nothing: the caller owns the groups.
        assert set(group_states("plt-stale").values()) == {"PENDING"}
    finally:
        remove_groups([*groups, blocker])
    wait_for(lambda: all_removed("plt-stale"))
    wait_for(lambda: idle(read_inventory("GPU")))


def test_infeasible_request_names_every_node(inventory: Inventory) -> None:
    with pytest.raises(PlacementError) as info:
        plan_placement(inventory, dp_size=3, world_size=4, strategy="strict")
    msg = str(info.value)
    assert "dp_size=3 x world_size=4: needs 12 GPU on nodes with >=4 GPU free" in msg
    for n in inventory.nodes:
        row = next(line for line in msg.splitlines() if line.strip().startswith(inventory.short(n.node_id)))
        assert f"{n.free}/{n.devices}" in row
    assert "dp_size=2 would fit" in msg


def test_user_groups_are_validated(cluster: Cluster) -> None:
    good = placement_group([{"GPU": 1.0}, {"CPU": 1.0}], strategy="STRICT_PACK", name="plt-user-good")
    spread = placement_group([{"GPU": 1.0}, {"GPU": 1.0}], strategy="SPREAD", name="plt-user-bad")
    try:
        assert good.wait(30)
        validate_user_groups([good], dp_size=1, world_size=1, accelerator="GPU")
        with pytest.raises(ConfigError, match=r"got 1 groups, dp_size=2"):
            validate_user_groups([good], dp_size=2, world_size=1, accelerator="GPU")
        with pytest.raises(ConfigError) as info:
            validate_user_groups([good, spread, good], dp_size=3, world_size=1, accelerator="GPU")
        msg = str(info.value)
        assert "placement_groups[1]: strategy 'SPREAD'" in msg
        assert "placement_groups[1]: last bundle is {GPU: 1}, needs CPU >= 1" in msg
        assert "placement_groups[2]: is the same group as placement_groups[0]" in msg
        remove_groups([good])
        wait_for(lambda: placement_group_table(good)["state"] == "REMOVED")
        with pytest.raises(ConfigError, match=r"placement_groups\[0\]: group plt-user-good is REMOVED"):
            validate_user_groups([good], dp_size=1, world_size=1, accelerator="GPU")
    finally:
        remove_groups([good, spread])


def test_existing_names_are_refused_and_lifetime_passes_through(inventory: Inventory) -> None:
    plan = plan_placement(inventory, dp_size=1, world_size=1)
    groups = create_groups(plan, "plt-named", lifetime="detached")
    try:
        wait_ready(groups, 30)
        assert is_detached(groups[0])
        with pytest.raises(ConfigError, match="'plt-named-dp0' already exists"):
            create_groups(plan, "plt-named")
        with pytest.raises(ConfigError, match="lifetime='forever'"):
            create_groups(plan, "plt-other", lifetime="forever")
    finally:
        remove_groups(groups)
    wait_for(lambda: all_removed("plt-named"))
    again = create_groups(plan, "plt-named")  # a removed group's name is free again
    try:
        wait_ready(again, 30)
        entry = placement_group_table(again[0])
        assert (entry["name"], entry["state"]) == ("plt-named-dp0", "CREATED")
    finally:
        remove_groups(again)
    wait_for(lambda: all_removed("plt-named"))


def plan_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="raydp")
    cli_plan.add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["plan", *argv])


def test_plan_command_prints_the_table_and_creates_nothing(
    inventory: Inventory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    before = len(placement_group_table())
    head = inventory.nodes[0]
    assert cli_plan.run(plan_args("--dp-size", "5", "--world-size", "2", "--master", head.node_id[:8])) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("plan: dp_size=5 world_size=2 accelerator=GPU strategy=fill")
    assert lines[1].split()[:3] == ["rank", "node", "ip"]
    assert len(lines) == 7 and "(head) *" in lines[2]

    assert cli_plan.run(plan_args("--dp-size", "2", "--world-size", "4", "--json", "--master", head.node_id)) == 0
    data: dict[str, Any] = json.loads(capsys.readouterr().out)
    assert data["ranks"][0]["node_id"] == head.node_id and data["dp_size_local"] == 1

    assert cli_plan.run(plan_args("--dp-size", "9", "--world-size", "2")) == 2
    err = capsys.readouterr().err
    assert "dp_size=9 x world_size=2" in err and "dp_size=5 would fit" in err
    assert cli_plan.run(plan_args("--dp-size", "1", "--master", "zzzz")) == 2
    assert "master_node_id='zzzz' matches no alive node" in capsys.readouterr().err
    assert len(placement_group_table()) == before


def test_plan_command_shows_a_p_d_clusters_pools_each_on_what_the_other_left(
    inventory: Inventory, capsys: pytest.CaptureFixture[str]
) -> None:
    before = len(placement_group_table())
    head = inventory.nodes[0].node_id
    pools = ["--prefill-dp-size", "1", "--decode-dp-size", "3", "--master", head]
    sizes = ["--prefill-tensor-parallel-size", "4", "--tensor-parallel-size", "2"]
    assert cli_plan.run(plan_args(*pools, *sizes, "--json")) == 0
    plans = json.loads(capsys.readouterr().out)["plans"]
    assert [(p["world_size"], [(r["rank"], r["pool"]) for r in p["ranks"]]) for p in plans] == [
        (4, [(0, "prefill")]),
        (2, [(1, "decode"), (2, "decode"), (3, "decode")]),
    ]
    taken = Counter(n for p in plans for r in p["ranks"] for n in r["bundle_node_ids"][:-1])
    assert taken == {n.node_id: n.free for n in inventory.nodes}, "4 + 3 x 2 devices on 4 + 4 + 2, none twice"

    assert cli_plan.run(plan_args(*pools, *sizes)) == 0
    prefill, decode = capsys.readouterr().out.split("\n\n")
    assert prefill.startswith("plan: dp_size=1 world_size=4") and decode.startswith("plan: dp_size=3 world_size=2")
    assert [line.split()[-1] for line in decode.splitlines()[2:]] == ["decode"] * 3

    # The prefill rank takes 2 of the head's 4: then only 1 of 3 decode ranks of 4 fits.
    assert cli_plan.run(plan_args(*pools, "--prefill-tensor-parallel-size", "2", "--tensor-parallel-size", "4")) == 2
    assert "cannot place dp_size=3 x world_size=4" in capsys.readouterr().err
    assert cli_plan.run(plan_args(*pools, "--world-size", "2")) == 2
    assert "--world-size: a P/D cluster's pools size their own ranks" in capsys.readouterr().err
    assert len(placement_group_table()) == before


def test_plan_command_in_a_subprocess_uses_ray_address(cluster: Cluster) -> None:
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    argv = ["plan", "--dp-size", "3", "--world-size", "2", "--strategy", "strict"]
    out = subprocess.run(
        [sys.executable, "-m", "raydp", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("plan: dp_size=3 world_size=2")
    assert len(lines) == 5
