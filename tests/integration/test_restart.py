"""Dense mode: a dead rank is restarted in its placement group and rejoins."""

from __future__ import annotations

from typing import Any

import pytest
import ray

import raydp
from raydp.errors import EngineDeadError
from tests.integration.helpers import live_groups, wait_until


def serves(client: Any, rank: int) -> bool:
    try:
        return bool(client.generate([rank + 1], max_tokens=1, rank=rank, timeout=5) == [rank + 1])
    except raydp.RaydpError:
        return False


@pytest.mark.timeout(180)
def test_a_killed_dense_rank_restarts_once_then_stays_dead(two_nodes: Any) -> None:
    with raydp.launch(name="restart", dp_size=2, max_restarts=1, progress=False) as cluster:
        client = cluster.client()
        group_before = cluster._manager.slots[1].group.id
        pending = client.submit([1], max_tokens=1_000_000, rank=1)
        ray.kill(cluster._manager.engines[1], no_restart=True)
        with pytest.raises(EngineDeadError, match="restarting it"):
            pending.result(timeout=10)
        assert wait_until(lambda: serves(client, 1), timeout=60), "rank 1 came back"
        assert cluster.wait(timeout=0.5) is None, "a recovered death does not end wait()"
        assert [e.rank for e in cluster.deaths] == [1] and cluster.deaths[0].restarting
        assert cluster._manager.slots[1].group.id == group_before, "restarted in its own group"
        assert serves(client, 0)
        fresh = cluster.client()
        assert serves(fresh, 1), "clients made after the restart reach the new rank too"
        # The policy allowed one restart: the second death is final.
        ray.kill(cluster._manager.engines[1], no_restart=True)
        with pytest.raises(EngineDeadError) as info:
            cluster.wait(timeout=10)
        assert info.value.rank == 1 and not info.value.restarting
    assert wait_until(lambda: not live_groups("restart"))


@pytest.mark.timeout(180)
def test_a_rank_whose_step_raised_is_restarted(two_nodes: Any) -> None:
    with raydp.launch(
        name="poison", dp_size=2, max_restarts=1, progress=False, engine="tests.integration.engines:PoisonEngine"
    ) as cluster:
        client = cluster.client()
        with pytest.raises(raydp.RequestError, match="device fault"):
            client.generate([666], max_tokens=1, rank=0, timeout=30)
        assert wait_until(lambda: bool(cluster.deaths), timeout=10)
        assert cluster.deaths[0].cause.value == "engine error" and cluster.deaths[0].restarting
        assert wait_until(lambda: serves(client, 0), timeout=60), "rank 0 came back"
        assert cluster.wait(timeout=0.5) is None
