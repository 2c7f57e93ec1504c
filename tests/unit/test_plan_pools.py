"""``raydp plan`` for P/D clusters: pools of different sizes are planned one after the other, each on
what the plans before it leave (nothing is reserved in a dry run), and every rank is shown with its pool."""

from __future__ import annotations

from collections import Counter

import pytest

from raydp.config import RaydpConfig
from raydp.errors import PlacementError
from raydp.placement.inventory import Inventory, NodeInfo
from raydp.placement.pools import plan_pools, pool_of, reserve
from raydp.placement.report import format_plan_table, plan_to_json

pytestmark = pytest.mark.timeout(30)
A, B = "a" * 56, "b" * 56


def inventory(*gpus: int, cpus: float = 8.0) -> Inventory:
    return Inventory(
        tuple(
            NodeInfo(node_id=nid, ip="10.0.0.1", is_head=nid == A, total=g, available=g, cpus_available=cpus)
            for nid, g in zip((A, B), gpus, strict=False)
        )
    )


def pd(prefill: int, decode: int, prefill_tp: int, tp: int) -> RaydpConfig:
    return RaydpConfig(
        prefill_dp_size=prefill, decode_dp_size=decode, prefill_tensor_parallel_size=prefill_tp, tensor_parallel_size=tp
    )


def test_reserve_takes_each_ranks_devices_and_its_engine_cores_cpu_where_it_lands() -> None:
    inv = inventory(4, 2)
    (pool,) = plan_pools(inv, RaydpConfig(dp_size=2, tensor_parallel_size=2), master_node_id=A)
    left = reserve(inv, pool.plan)
    used = Counter(n for r in pool.plan.ranks for n in pool.plan.bundle_node_ids(r.rank)[:-1])
    engine_cores = Counter(r.node_id for r in pool.plan.ranks)
    for before, after in zip(inv.nodes, left.nodes, strict=True):
        assert after.available == before.available - used[before.node_id]
        assert after.cpus_available == 8.0 - engine_cores[before.node_id]


def test_pools_of_different_sizes_are_planned_one_after_the_other_without_sharing_a_device() -> None:
    inv = inventory(4, 2)
    prefill, decode = plan_pools(inv, pd(1, 2, prefill_tp=2, tp=1), master_node_id=A)
    assert (prefill.ranks, prefill.plan.world_size) == (range(1), 2)
    assert (decode.ranks, decode.plan.world_size) == (range(1, 3), 1)
    prefill, decode = plan_pools(inv, pd(1, 2, prefill_tp=4, tp=1), master_node_id=A)
    assert (prefill.plan.world_size, decode.plan.world_size) == (4, 1)
    taken = Counter(n for p in (prefill, decode) for r in p.plan.ranks for n in p.plan.bundle_node_ids(r.rank)[:-1])
    assert taken == {A: 4, B: 2}, "the decode pool goes where the prefill pool left room"


def test_pools_of_one_size_are_one_plan_as_at_launch() -> None:
    (pool,) = plan_pools(inventory(4, 2), pd(1, 2, prefill_tp=2, tp=2), master_node_id=A)
    assert (pool.ranks, pool.plan.world_size) == (range(3), 2)


def test_a_pool_that_no_longer_fits_after_the_one_before_is_refused() -> None:
    with pytest.raises(PlacementError, match="dp_size=2 x world_size=2"):
        plan_pools(inventory(4, 2), pd(1, 2, prefill_tp=4, tp=2), master_node_id=A)  # B holds one of two


def test_each_rank_is_shown_with_its_cluster_rank_and_pool() -> None:
    inv = inventory(4, 2)
    config = pd(1, 2, prefill_tp=4, tp=1)
    plans = plan_pools(inv, config, master_node_id=A)
    tables = [
        format_plan_table(p.plan, inv, first_rank=p.first_rank, pool_of=lambda r: pool_of(config, r)) for p in plans
    ]
    rows = [line.split() for table in tables for line in table.splitlines()[2:]]
    assert [(row[0], row[-1]) for row in rows] == [("0", "prefill"), ("1", "decode"), ("2", "decode")]
    found = [plan_to_json(p.plan, first_rank=p.first_rank, pool_of=lambda r: pool_of(config, r)) for p in plans]
    assert [(r["rank"], r["pool"]) for plan in found for r in plan["ranks"]] == [
        (0, "prefill"),
        (1, "decode"),
        (2, "decode"),
    ]
    assert pool_of(RaydpConfig(dp_size=2), 1) == ""
