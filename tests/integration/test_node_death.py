"""Removing a worker node mid-run reports its ranks dead with cause 'node died'."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import openai
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
        cluster_pool.key = None  # this cluster lost a node: nobody else may reuse it
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
        cluster_pool.key = None  # this cluster lost a node: nobody else may reuse it
    assert wait_until(lambda: not live_groups("replace"), timeout=30)


@pytest.mark.timeout(300)
def test_the_coordinators_node_dying_moves_it_to_a_live_node_and_every_client_follows(
    cluster_pool: ClusterPool,
) -> None:
    """Its successor binds new addresses on a live node; engines are told, clients find it.

    The launching process's clients follow at once; an attached handle's clients and the API
    server processes (which hear of the coordinator only through it) ask an engine once it is
    silent. Rank 0, which shared the node, is re-placed. Load-aware routing then runs on what
    the new coordinator hears from the engines, as ``raydp status`` shows.
    """
    ray_cluster = cluster_pool.get((4, 4), fresh=True)
    worker = next(n for n in ray_cluster.worker_nodes)
    cluster = raydp.launch(
        name="coordnode",
        dp_size=4,
        dp_size_local=2,
        master_node_id=worker.node_id,
        max_restarts=1,
        progress=False,
        engine_kwargs={"step_delay_s": 0.002},
    )
    attached = None
    try:
        client = cluster.client()
        servers = cluster.serve_api(1)
        attached = raydp.attach("coordnode")
        elsewhere = attached.client()
        assert cluster.endpoints.coordinator.node_id == worker.node_id, "the coordinator lives beside rank 0"
        removed_at = time.monotonic()
        ray_cluster.remove_node(worker)
        assert wait_until(lambda: cluster.endpoints.coordinator.node_id != worker.node_id, timeout=60)
        print(f"\ncoordinator on a live node {time.monotonic() - removed_at:.1f}s after its node was removed")
        moved = [e for e in cluster.deaths if isinstance(e, CoordinatorDeadError)]
        assert moved and moved[0].cause is DeathCause.NODE_DIED and moved[0].restarting, cluster.deaths

        def healed() -> bool:
            state = cluster.coordinator_state()
            return not state.dead and state.restarts[0] == 1 and state.restarts[1] == 1

        assert wait_until(healed, timeout=120), cluster.coordinator_state()
        assert {e.rank for e in cluster.deaths if isinstance(e, EngineDeadError)} == {0, 1}

        def serves(who: raydp.Client, rank: int) -> bool:
            try:
                return bool(who.generate([rank + 1], max_tokens=2, rank=rank, timeout=10) == [rank + 1] * 2)
            except raydp.RaydpError:  # sent to a re-placed rank's old address before its move was heard
                return False

        for who in (client, elsewhere):
            for r in range(4):
                assert wait_until(lambda who=who, r=r: serves(who, r), timeout=60), f"rank {r} serves"
        sdk = openai.OpenAI(base_url=f"{servers.url}/v1", api_key="x", max_retries=0, timeout=30)
        assert sdk.completions.create(model="coordnode", prompt=[7], max_tokens=2).choices[0].text == "\x07\x07"
        # Load-aware routing runs on the new coordinator's picture: a long request on rank 2 shows.
        busy = client.submit([3], max_tokens=1_000_000, rank=2)
        assert wait_until(lambda: cluster.coordinator_state().counts[2][1] == 1, timeout=30)
        assert wait_until(lambda: (s := elsewhere.snapshot()) is not None and s.counts[2][1] == 1, timeout=30)
        out = subprocess.run(
            [sys.executable, "-m", "raydp", "status", "coordnode", "--json"],
            env={**os.environ, "RAY_ADDRESS": ray_cluster.address},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        (status,) = json.loads(out.stdout)
        assert [r["running"] for r in status["ranks"]] == [0, 0, 1, 0]
        assert [r["state"] for r in status["ranks"]] == ["serving"] * 4
        client.abort(busy.request_id)
    finally:
        if attached is not None:
            attached.close()
        cluster.close()
        cluster_pool.key = None
    assert wait_until(lambda: not live_groups("coordnode"), timeout=30)
