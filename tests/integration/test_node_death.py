"""Removing a worker node mid-run reports its ranks dead with cause 'node died'."""

from __future__ import annotations

import time

import pytest

import raydp
from raydp.errors import CoordinatorDeadError, DeathCause, EngineDeadError
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


@pytest.mark.timeout(240)
def test_ranks_of_a_dead_node_are_re_placed_on_the_nodes_that_remain(cluster_pool: ClusterPool) -> None:
    ray_cluster = cluster_pool.get((4, 4), fresh=True)
    cluster = raydp.launch(name="replace", dp_size=4, dp_size_local=2, max_restarts=1, progress=False)
    try:
        client = cluster.client()
        attached = raydp.attach("replace")  # kept: dropping the handle would close its client
        elsewhere = attached.client()  # follows from the coordinator's snapshots
        head = ray_cluster.head_node.node_id
        worker = next(n for n in ray_cluster.worker_nodes)
        assert [ep.node_id == worker.node_id for ep in cluster.endpoints.engines] == [False, False, True, True]
        assert cluster.endpoints.coordinator.node_id == head, "the coordinator lives beside rank 0"
        removed_at = time.monotonic()
        ray_cluster.remove_node(worker)

        def serving_again() -> bool:
            try:
                return all(
                    c.generate([r], max_tokens=2, rank=r, timeout=5) == [r, r]
                    for c in (client, elsewhere)
                    for r in (2, 3)
                )
            except raydp.RaydpError:
                return False

        assert wait_until(serving_again, timeout=120), cluster.deaths
        print(f"\nranks re-placed and serving {time.monotonic() - removed_at:.1f}s after the node died")
        dead = sorted((e.rank, e.cause, e.restarting) for e in cluster.deaths if isinstance(e, EngineDeadError))
        assert dead == [(2, DeathCause.NODE_DIED, True), (3, DeathCause.NODE_DIED, True)]
        assert [ep.node_id for ep in cluster.endpoints.engines] == [head] * 4, "the new ranks live on the head"
        assert cluster.coordinator_state().restarts == [0, 0, 1, 1]
        assert cluster.wait(timeout=0.1) is None, "a recovered death does not end the cluster"
    finally:
        cluster.close()
        cluster_pool.shape = None  # this cluster lost a node: nobody else may reuse it
    assert wait_until(lambda: not live_groups("replace"), timeout=30)


@pytest.mark.timeout(240)
def test_the_coordinators_node_dying_ends_it_for_good_while_every_rank_serves_on(cluster_pool: ClusterPool) -> None:
    """Stated behaviour: a coordinator cannot come back at addresses on a dead node.

    Its death is final (``CoordinatorDeadError``, not restarting); the dense ranks of that
    node are re-placed and, with the others, serve the launching process's clients, which
    route on their own in-flight counts from then on.
    """
    ray_cluster = cluster_pool.get((4, 4), fresh=True)
    worker = next(n for n in ray_cluster.worker_nodes)
    cluster = raydp.launch(
        name="coordnode", dp_size=4, dp_size_local=2, master_node_id=worker.node_id, max_restarts=1, progress=False
    )
    try:
        client = cluster.client()
        assert cluster.endpoints.coordinator.node_id == worker.node_id, "the coordinator lives beside rank 0"
        ray_cluster.remove_node(worker)
        with pytest.raises(CoordinatorDeadError) as info:
            cluster.wait(timeout=60)
        assert info.value.cause is DeathCause.NODE_DIED and not info.value.restarting

        def serving() -> bool:
            try:
                return all(client.generate([r + 1], max_tokens=2, rank=r, timeout=5) == [r + 1] * 2 for r in range(4))
            except raydp.RaydpError:
                return False

        assert wait_until(serving, timeout=120), cluster.deaths
        assert {e.rank for e in cluster.deaths if isinstance(e, EngineDeadError)} == {0, 1}
    finally:
        cluster.close()
        cluster_pool.shape = None
    assert wait_until(lambda: not live_groups("coordnode"), timeout=30)
