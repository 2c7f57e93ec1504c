"""Deaths are reported at once, naming the rank, the node and the cause."""

from __future__ import annotations

import time

import pytest
import ray

import raydp
from raydp.errors import CoordinatorDeadError, DeathCause, EngineDeadError, StartupError
from tests.integration.helpers import assert_nothing_left, live_actors, live_groups, wait_until


@pytest.mark.timeout(180)
def test_dp4_handshake_sums_capacity_and_a_killed_rank_is_reported_fast(two_nodes) -> None:  # type: ignore[no-untyped-def]
    cluster = raydp.launch(
        name="kill",
        dp_size=4,
        dp_size_local=2,
        engine_kwargs={"max_running": 64, "step_delay_s": 0.01},
        progress=False,
    )
    try:
        assert cluster.capacity == 4 * 64
        nodes = [ep.node_id for ep in cluster.endpoints.engines]
        assert nodes[0] == nodes[1] != nodes[2] == nodes[3], "two ranks per node, master first"
        client = cluster.client()
        in_flight = [client.submit([1, 2], max_tokens=10_000, rank=2) for _ in range(3)]
        elsewhere = client.submit([3], max_tokens=5, rank=0)
        assert elsewhere.result(timeout=30) == [3] * 5
        victim = cluster._manager.engines[2]
        killed_at = time.monotonic()
        ray.kill(victim, no_restart=True)
        with pytest.raises(EngineDeadError) as info:
            cluster.wait(timeout=30)
        latency = time.monotonic() - killed_at
        print(f"\nEngineDeadError after {latency * 1000:.0f} ms")
        err = info.value
        assert err.rank == 2
        assert err.cause is DeathCause.KILLED
        assert err.node_id == cluster.endpoints.engines[2].node_id
        # At once: event-driven (Ray's death notice), never a health check's silence; generous for a busy machine.
        assert latency < 20.0
        for handle in in_flight:
            with pytest.raises(EngineDeadError, match="rank 2"):
                handle.result(timeout=5)
        # The other ranks keep serving; new work avoids the dead one.
        later = [client.submit([4], max_tokens=2) for _ in range(20)]
        assert all(h.result(timeout=30) == [4, 4] for h in later)
        assert 2 not in {h.rank for h in later}
    finally:
        cluster.close()
    assert_nothing_left("kill")


@pytest.mark.timeout(180)
def test_engine_constructor_error_fails_launch_with_its_traceback(two_nodes) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(StartupError) as info:
        raydp.launch(
            name="broken",
            dp_size=2,
            engine="tests.integration.engines:BrokenConstructorEngine",
            engine_kwargs={"bad_rank": 1},
            startup_timeout_s=60,
            progress=False,
        )
    text = str(info.value)
    assert "rank 1" in text
    assert "checksum mismatch" in text
    assert "tests/integration/engines.py" in text, "the traceback's frames are shown"
    assert_nothing_left("broken")


@pytest.mark.timeout(180)
def test_a_killed_coordinator_ends_wait_while_dense_ranks_keep_serving(two_nodes) -> None:  # type: ignore[no-untyped-def]
    """With no restarts left, dense engines serve on without it, but the operator must hear it is gone."""
    cluster = raydp.launch(name="coorddead", dp_size=2, coordinator_max_restarts=0, progress=False)
    try:
        client = cluster.client()
        killed_at = time.monotonic()
        ray.kill(cluster._manager.coordinator, no_restart=True)
        with pytest.raises(CoordinatorDeadError) as info:
            cluster.wait(timeout=10)
        print(f"\nCoordinatorDeadError after {(time.monotonic() - killed_at) * 1000:.0f} ms")
        assert info.value.cause is DeathCause.KILLED
        assert info.value.node_id == cluster.endpoints.coordinator.node_id
        assert "coordinator of cluster 'coorddead'" in str(info.value) and "killed" in str(info.value)
        assert not info.value.restarting
        handles = [client.submit([5], max_tokens=3, rank=r) for r in (0, 1)]
        assert [h.result(timeout=30) for h in handles] == [[5, 5, 5]] * 2
    finally:
        cluster.close()
    assert wait_until(lambda: not live_actors("coorddead"))
    assert live_groups("coorddead") == []


@pytest.mark.timeout(180)
def test_a_killed_coordinator_fails_lockstep_work_loudly(two_nodes) -> None:  # type: ignore[no-untyped-def]
    """With no restarts left, lockstep ranks cannot wake each other: the gang stops and in-flight work fails."""
    cluster = raydp.launch(
        name="coordgang",
        dp_size=2,
        lockstep=True,
        engine_kwargs={"step_delay_s": 0.01},
        progress=False,
        coordinator_max_restarts=0,
    )
    try:
        client = cluster.client()
        assert client.generate([1], max_tokens=2, rank=1, timeout=60) == [1, 1]
        in_flight = client.submit([2], max_tokens=100_000, rank=0)
        ray.kill(cluster._manager.coordinator, no_restart=True)
        with pytest.raises(CoordinatorDeadError):
            cluster.wait(timeout=10)
        with pytest.raises(EngineDeadError, match="rank 0"):
            in_flight.result(timeout=15)
    finally:
        cluster.close()
    assert_nothing_left("coordgang")
