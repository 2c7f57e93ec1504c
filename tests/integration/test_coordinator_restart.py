"""A dead coordinator is restarted at its addresses; its state is rebuilt; nothing in flight is lost."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import ray

import raydp
from raydp.errors import CoordinatorDeadError
from raydp.names import NAMESPACE, coordinator_name
from raydp.testing.leftovers import actor_table
from tests.integration.helpers import assert_nothing_left, wait_until

ECHO_SLOW = {"step_delay_s": 0.01}


def coordinator_pid(name: str) -> int:
    actor = ray.get_actor(coordinator_name(name), namespace=NAMESPACE)
    actor_id = actor._actor_id.hex()
    found = [a for a in actor_table() if a.actor_id == actor_id]
    assert found and found[0].pid, f"no pid for the coordinator of {name!r}"
    return found[0].pid


def restarted(cluster: Any, engines: int, deaths: int = 1) -> bool:
    """The successor serves: it answers Ray calls, every live engine resubscribed and reported its state.

    ``deaths``: the coordinator deaths reported so far, this one included (until then, a
    killed actor that has not gone yet may still answer as if nothing happened).
    """
    if len(cluster.deaths) < deaths:
        return False
    try:
        state = cluster.coordinator_state()
        return len(state.subscribed) == engines and state.resynced
    except Exception:  # the old actor is gone and the new one not there yet
        return False


@pytest.mark.timeout(180)
def test_a_killed_dense_coordinator_restarts_and_nothing_in_flight_is_lost(two_nodes: Any) -> None:
    name = "coordrestart"
    with raydp.launch(
        name=name, dp_size=2, coordinator_max_restarts=1, progress=False, engine_kwargs=ECHO_SLOW
    ) as cluster:
        client = cluster.client()
        attached = raydp.attach(name)
        remote = attached.client()  # follows the coordinator's snapshots, as an API server does
        assert remote.generate([5], max_tokens=2, timeout=30) == [5, 5]
        in_flight = [client.submit([i + 1], max_tokens=100) for i in range(20)]
        in_flight += [remote.submit([i + 1], max_tokens=100) for i in range(20)]
        killed = time.monotonic()
        os.kill(coordinator_pid(name), signal.SIGKILL)
        assert wait_until(lambda: bool(cluster.deaths), timeout=20)  # event-driven; generous for a busy machine
        detected = time.monotonic() - killed
        death = cluster.deaths[0]
        assert isinstance(death, CoordinatorDeadError) and death.restarting, death
        assert wait_until(lambda: restarted(cluster, 2), timeout=20), "the coordinator came back"
        back = time.monotonic() - killed
        print(f"coordinator SIGKILL: detected in {detected:.3f}s, back in {back:.2f}s")
        # Every request that was in flight completes, in full, once.
        for i, handle in enumerate(in_flight):
            assert handle.result(timeout=60) == [i % 20 + 1] * 100
        assert cluster.wait(timeout=0.5) is None, "a restarted coordinator does not end wait()"
        # Loads come back from the engines; snapshots reach a client in another process again.
        busy = client.submit([9], max_tokens=300, rank=1)
        assert wait_until(lambda: cluster.coordinator_state().counts[1] != [0, 0], timeout=10)
        first = remote.snapshot()
        seq = first.seq if first else 0
        assert wait_until(lambda: (snap := remote.snapshot()) is not None and snap.seq > seq, 10)
        assert busy.result(timeout=60) == [9] * 300
        assert remote.generate([7], max_tokens=3, timeout=30) == [7, 7, 7]
        # The restart policy allowed one: the next death is final.
        ray.kill(ray.get_actor(coordinator_name(name), namespace=NAMESPACE), no_restart=True)
        with pytest.raises(CoordinatorDeadError) as info:
            cluster.wait(timeout=10)
        assert not info.value.restarting
        attached.close()
    assert_nothing_left(name)


@pytest.mark.timeout(180)
def test_a_lockstep_coordinator_restarts_mid_wave_and_no_rank_is_stranded(two_nodes: Any) -> None:
    name = "coordrestartls"
    with raydp.launch(
        name=name,
        dp_size=2,
        lockstep=True,
        allreduce_interval=4,
        progress=False,
        engine_kwargs={"collective": True, "step_delay_s": 0.005},
    ) as cluster:
        client = cluster.client()
        assert client.generate([3], max_tokens=2, rank=1, timeout=60) == [3, 3]  # a wave, then pause
        assert wait_until(lambda: not cluster.coordinator_state().running, timeout=30)
        wave = cluster.coordinator_state().wave
        # Killed while paused: the next request, to the other rank, needs the successor's START_DP_WAVE.
        ray.kill(ray.get_actor(coordinator_name(name), namespace=NAMESPACE), no_restart=True)
        assert wait_until(lambda: restarted(cluster, 2, deaths=1), timeout=20)
        assert cluster.coordinator_state().wave == wave, "the wave came back from the engines"
        assert client.generate([4], max_tokens=2, rank=0, timeout=30) == [4, 4]
        # Killed mid-wave: rank 1 steps in the collective with rank 0; both finish.
        long = client.submit([6], max_tokens=400, rank=1)
        assert wait_until(lambda: cluster.coordinator_state().running, timeout=10)
        ray.kill(ray.get_actor(coordinator_name(name), namespace=NAMESPACE), no_restart=True)
        assert wait_until(lambda: restarted(cluster, 2, deaths=2), timeout=20)
        assert long.result(timeout=60) == [6] * 400
        assert client.generate([8], max_tokens=2, rank=0, timeout=30) == [8, 8]
        assert wait_until(lambda: not cluster.coordinator_state().running, timeout=30), "the wave ended"
        assert cluster.coordinator_state().wave > wave
        assert cluster.wait(timeout=0.5) is None
        assert [type(d) for d in cluster.deaths] == [CoordinatorDeadError] * 2
    assert_nothing_left(name)
