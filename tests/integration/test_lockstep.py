"""Lockstep DP=3: waves, dummy batches, pausing together, an idle cluster is quiet."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import ray

import raydp
from raydp.errors import EngineDeadError
from tests.integration.helpers import assert_nothing_left, wait_until

INTERVAL = 8
# Generous: the first test also pays for the module's DP=3 lockstep launch.
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def lockstep(two_nodes: Any) -> Iterator[Any]:
    cluster = raydp.launch(
        name="lockstep",
        dp_size=3,
        lockstep=True,
        allreduce_interval=INTERVAL,
        # Intervals of exactly INTERVAL steps, so the tests can bound a pause in steps (by
        # default an interval also lasts 5 ms: the pacing has its own tests, test_lockstep_pacing.py).
        allreduce_min_interval_s=0,
        engine_kwargs={"collective": True, "max_running": 8},
        progress=False,
    )
    yield cluster
    cluster.close()


def stats(client: Any, dp_size: int = 3) -> list[dict[str, int]]:
    return [client.call_utility(rank, "stats") for rank in range(dp_size)]


def test_cold_start_with_the_first_request_on_the_last_rank(lockstep: Any) -> None:
    client = lockstep.client()
    assert lockstep.coordinator_state().running is False
    assert client.generate([7, 8], max_tokens=3, rank=2, timeout=60) == [7, 8, 7]
    assert wait_until(lambda: lockstep.coordinator_state().running is False, timeout=30)
    per_rank = stats(client)
    # Ranks 0 and 1 were woken and ran dummy batches in step with rank 2's forward passes.
    assert per_rank[0]["dummy_steps"] > 0 and per_rank[1]["dummy_steps"] > 0
    assert per_rank[0]["collectives"] == per_rank[1]["collectives"] == per_rank[2]["collectives"] > 0


def test_requests_to_rank0_only_keep_every_rank_in_step_and_then_pause(lockstep: Any) -> None:
    client = lockstep.client()
    wave_before = _paused_wave(lockstep)
    handles = [client.submit([i], max_tokens=20, rank=0) for i in range(30)]
    assert all(h.result(timeout=60) == [i] * 20 for i, h in enumerate(handles))
    assert wait_until(lambda: lockstep.coordinator_state().running is False, timeout=30)
    state = lockstep.coordinator_state()
    assert state.wave > wave_before, "the finished wave was reported and the next one begun"
    per_rank = stats(client)
    forwards = [s["steps"] + s["dummy_steps"] for s in per_rank]
    collectives = [s["collectives"] for s in per_rank]
    assert per_rank[1]["dummy_steps"] > 0 and per_rank[2]["dummy_steps"] > 0
    # Every forward pass all-reduced over the DP group: equal counts on every rank
    # are what lockstep means (a rank missing one would have hung the others).
    assert collectives[0] == collectives[1] == collectives[2] == forwards[0]
    # They paused after the same step: one whose all-reduce said nobody had work.
    assert forwards[0] == forwards[1] == forwards[2], forwards
    assert forwards[0] % INTERVAL == 0, "ranks pause only at an all-reduce"
    # The all-reduce is collected an interval after it starts, then confirmed: a wave
    # ends at most two intervals after its last work.
    assert forwards[0] - per_rank[0]["last_work_step"] <= 2 * INTERVAL, "paused within two intervals"


def test_an_idle_cluster_is_quiet(lockstep: Any) -> None:
    client = lockstep.client()
    assert wait_until(lambda: lockstep.coordinator_state().running is False, timeout=30)
    before = stats(client)
    pids = [ray.get(a.wait_for_init.remote())["pid"] for a in lockstep._manager.engines]
    procs = [psutil.Process(pid) for pid in pids]
    cpu0 = [sum(p.cpu_times()[:2]) for p in procs]
    time.sleep(5)
    used = [(sum(p.cpu_times()[:2]) - c) / 5 for p, c in zip(procs, cpu0, strict=True)]
    print(f"\nidle CPU per engine: {[f'{u:.1%}' for u in used]}")
    after = stats(client)
    assert [s["dummy_steps"] for s in after] == [s["dummy_steps"] for s in before], "no dummy batches"
    assert [s["steps"] for s in after] == [s["steps"] for s in before], "no steps"
    # A loop that polls without sleeping takes most of a core whatever the machine's speed; an
    # idle one wakes for heartbeats only (about 1% here). Far from both: no speed decides it.
    assert all(u < 0.25 for u in used), used


def _paused_wave(cluster: Any) -> int:
    assert wait_until(lambda: cluster.coordinator_state().running is False, timeout=30)
    return int(cluster.coordinator_state().wave)


@pytest.mark.timeout(240)
def test_a_lockstep_death_restarts_the_whole_gang_and_it_serves_again(two_nodes: Any) -> None:
    cluster = raydp.launch(
        name="gang",
        dp_size=3,
        lockstep=True,
        max_restarts=1,
        progress=False,
        engine_kwargs={"collective": True, "step_delay_s": 0.01},
    )
    try:
        client = cluster.client()
        assert client.generate([1], max_tokens=2, rank=2) == [1, 1]
        in_flight = client.submit([4], max_tokens=100_000, rank=2)
        moved = client.submit([5], max_tokens=3, rank=1, retryable=True)
        killed_at = time.monotonic()
        ray.kill(ray.get_actor("gang-dp0", namespace="raydp"))
        with pytest.raises(EngineDeadError, match="rank 2"):
            in_flight.result(timeout=30)  # its rank was stopped with the gang: it fails, typed

        def serving() -> bool:
            try:
                return all(client.generate([r], max_tokens=2, rank=r, timeout=5) == [r, r] for r in range(3))
            except raydp.RaydpError:
                return False

        assert wait_until(serving, timeout=60), cluster.deaths
        back = time.monotonic() - killed_at
        print(f"\nlockstep gang back in {back:.1f}s")
        assert back < 30
        try:  # retryable, but every rank went down at once: served, or failed with the typed error
            assert moved.result(timeout=30) == [5, 5, 5]
        except EngineDeadError:
            pass
        deaths = sorted((e.rank, e.restarting) for e in cluster.deaths if isinstance(e, EngineDeadError))
        assert deaths == [(0, True), (1, True), (2, True)], "every rank of the gang went down and came back"
        stats = [client.call_utility(r, "stats") for r in range(3)]
        assert [s["dp_group_size"] for s in stats] == [3, 3, 3], "the new DP group has every rank"
        assert cluster.coordinator_state().restarts == [1, 1, 1]
        assert cluster.wait(timeout=0.1) is None
        ray.kill(ray.get_actor("gang-dp1", namespace="raydp"))  # no restarts left: the gang ends
        with pytest.raises(EngineDeadError, match="rank 1"):
            cluster.wait(timeout=30)
    finally:
        cluster.close()
    assert_nothing_left("gang", timeout=30)


@pytest.mark.timeout(240)
def test_a_gang_restarts_twice_into_new_processes_that_step_together(two_nodes: Any) -> None:
    cluster = raydp.launch(
        name="gang2",
        dp_size=3,
        lockstep=True,
        max_restarts=2,
        progress=False,
        allreduce_interval=INTERVAL,
        engine_kwargs={"collective": True},
    )
    try:
        client = cluster.client()
        seen_pids = set(_pids(cluster))
        for restart, victim in enumerate((2, 1), start=1):  # never rank 0: its successor hosts the rendezvous
            ray.kill(ray.get_actor(f"gang2-dp{victim}", namespace="raydp"))

            def serving() -> bool:
                try:
                    return all(client.generate([r], max_tokens=2, rank=r, timeout=5) == [r, r] for r in range(3))
                except raydp.RaydpError:
                    return False

            assert wait_until(serving, timeout=60), cluster.deaths
            pids = _pids(cluster)
            assert not seen_pids & set(pids), "every rank of the gang runs in a new process"
            seen_pids |= set(pids)
            assert cluster.coordinator_state().restarts == [restart] * 3
            # A request on rank 2 alone wakes the others: the new DP group steps together.
            assert client.generate([9], max_tokens=20, rank=2, timeout=60) == [9] * 20
            assert wait_until(lambda: cluster.coordinator_state().running is False, timeout=30)
            per_rank = stats(client)
            assert per_rank[0]["dummy_steps"] > 0 and per_rank[1]["dummy_steps"] > 0
            assert per_rank[0]["collectives"] == per_rank[1]["collectives"] == per_rank[2]["collectives"] > 0
            assert [s["dp_group_size"] for s in per_rank] == [3, 3, 3]
        deaths = [e for e in cluster.deaths if isinstance(e, EngineDeadError)]
        assert len(deaths) == 6 and all(e.restarting for e in deaths), deaths
        assert cluster.wait(timeout=0.1) is None, "both restarts were within max_restarts"
    finally:
        cluster.close()
    assert_nothing_left("gang2", timeout=30)


def _pids(cluster: Any) -> list[int]:
    return [ray.get(a.wait_for_init.remote(), timeout=30)["pid"] for a in cluster._manager.engines]
