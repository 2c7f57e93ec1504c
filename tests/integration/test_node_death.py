"""Removing a worker node mid-run reports its ranks dead with cause 'node died'."""

from __future__ import annotations

import time

import pytest

import raydp
from raydp.errors import DeathCause, EngineDeadError
from tests.integration.conftest import ClusterPool
from tests.integration.helpers import live_groups, wait_until


@pytest.mark.timeout(240)
def test_removing_a_node_reports_its_ranks_as_node_died(cluster_pool: ClusterPool) -> None:
    ray_cluster = cluster_pool.get((4, 4), fresh=True)
    cluster = raydp.launch(name="nodedeath", dp_size=4, dp_size_local=2, progress=False)
    try:
        client = cluster.client()
        worker = next(n for n in ray_cluster.worker_nodes)
        doomed = [ep.rank for ep in cluster.endpoints.engines if ep.node_id == worker.node_id]
        assert doomed == [2, 3]
        pending = client.submit([9], max_tokens=1_000_000, rank=3)
        removed_at = time.monotonic()
        ray_cluster.remove_node(worker)
        assert wait_until(lambda: len(cluster.deaths) >= 2, timeout=120), cluster.deaths
        print(f"\nnode death reported after {time.monotonic() - removed_at:.1f}s")
        dead = {e.rank: e for e in cluster.deaths if isinstance(e, EngineDeadError)}
        assert sorted(dead) == [2, 3]
        for err in dead.values():
            assert err.cause is DeathCause.NODE_DIED, err
            assert err.node_id == worker.node_id
            assert "node died" in str(err)
        with pytest.raises(EngineDeadError, match="rank 3"):
            pending.result(timeout=10)
        assert client.generate([5], max_tokens=2, timeout=30) == [5, 5]
    finally:
        cluster.close()
        cluster_pool.shape = None  # this cluster lost a node: nobody else may reuse it
    assert wait_until(lambda: not live_groups("nodedeath"), timeout=30)
