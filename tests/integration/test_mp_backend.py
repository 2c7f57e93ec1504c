"""The multiprocessing backend: DP=2 as local processes, no Ray."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

import raydp
from raydp.errors import DeathCause, EngineDeadError
from tests.integration.helpers import socket_dirs, wait_until


@pytest.mark.timeout(120)
def test_mp_dp2_serves_and_sigkill_is_reported_within_a_second() -> None:
    cluster = raydp.launch(name="mpdp", dp_size=2, backend="mp", progress=False,
                           engine_kwargs={"step_delay_s": 0.005})
    procs = cluster._manager.procs
    try:
        client = cluster.client()
        handles = [client.submit([i], max_tokens=3) for i in range(40)]
        assert [h.result(timeout=30) for h in handles] == [[i] * 3 for i in range(40)]
        assert {h.rank for h in handles} == {0, 1}
        assert cluster.capacity == 2 * 256
        victim = next(p for p in procs if p.rank == 1)
        pending = client.submit([1], max_tokens=1_000_000, rank=1)
        killed_at = time.monotonic()
        os.kill(victim.process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError) as info:
            cluster.wait(timeout=10)
        latency = time.monotonic() - killed_at
        print(f"\nmp backend: EngineDeadError after {latency * 1000:.0f} ms: {info.value}")
        assert latency < 1.0
        assert info.value.rank == 1
        assert info.value.cause is DeathCause.KILLED
        assert "SIGKILL" in str(info.value) and str(victim.process.pid) in str(info.value)
        with pytest.raises(EngineDeadError):
            pending.result(timeout=5)
    finally:
        cluster.close()
    assert not any(psutil.pid_exists(p.process.pid) and p.process.is_alive() for p in procs)
    assert socket_dirs("mpdp") == []


@pytest.mark.timeout(120)
def test_dropping_the_last_handle_stops_the_processes() -> None:
    import gc

    cluster = raydp.launch(name="mpgc", dp_size=2, backend="mp", progress=False)
    procs = cluster._manager.procs
    assert cluster.client().generate([3], max_tokens=1) == [3]
    del cluster
    gc.collect()
    assert wait_until(lambda: not any(p.process.is_alive() for p in procs), timeout=20)
    assert socket_dirs("mpgc") == []


@pytest.mark.timeout(120)
def test_abort_finishes_the_handle_and_frees_the_engine() -> None:
    with raydp.launch(name="mpabort", dp_size=1, backend="mp", progress=False,
                      engine_kwargs={"step_delay_s": 0.001}) as cluster:
        client = cluster.client()
        handle = client.submit([8], max_tokens=10**7, request_id="long")
        first = next(handle.stream(timeout=10))
        assert first == [8]
        client.abort("long")
        tokens = handle.result(timeout=10)
        assert handle.finish_reason == "abort" and tokens[:1] == [8]
        idle = lambda: cluster.coordinator_state()["counts"][0] == [0, 0]  # noqa: E731
        assert wait_until(idle, timeout=10), "the engine dropped the request"
        # The id is free again once the abort went through.
        assert client.generate([9], max_tokens=1, request_id="long") == [9]


@pytest.mark.timeout(120)
def test_a_killed_rank_restarts_while_max_restarts_allows_then_stays_dead() -> None:
    with raydp.launch(name="mprestart", dp_size=2, backend="mp", max_restarts=1, progress=False,
                      engine_kwargs={"step_delay_s": 0.002}) as cluster:
        client = cluster.client()
        assert client.generate([4], max_tokens=2, rank=1) == [4, 4]
        first = next(p for p in cluster._manager.procs if p.rank == 1)
        pending = client.submit([1], max_tokens=1_000_000, rank=1)
        os.kill(first.process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError) as info:
            pending.result(timeout=10)
        assert info.value.rank == 1 and info.value.restarting and "restarting it" in str(info.value)

        def serves() -> bool:
            try:
                return client.generate([5], max_tokens=1, rank=1, timeout=5) == [5]
            except raydp.RaydpError:
                return False

        assert wait_until(serves, timeout=30), "rank 1 came back"
        second = next(p for p in cluster._manager.procs if p.rank == 1)
        assert second.process.pid != first.process.pid and not first.process.is_alive()
        assert wait_until(lambda: cluster.coordinator_state()["restarts"] == [0, 1], timeout=10)
        assert client.generate([6], max_tokens=1, rank=0) == [6], "rank 0 served throughout"

        os.kill(second.process.pid, signal.SIGKILL)  # no restarts left
        assert wait_until(lambda: len(cluster.deaths) == 2, timeout=10)
        assert not cluster.deaths[-1].restarting  # type: ignore[attr-defined]
        with pytest.raises(EngineDeadError):
            client.generate([7], max_tokens=1, rank=1, timeout=10)
        time.sleep(1.0)
        assert [p.process.pid for p in cluster._manager.procs if p.rank == 1] == [second.process.pid]
    assert socket_dirs("mprestart") == []
