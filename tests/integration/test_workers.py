"""Device workers inside a rank: one per device bundle, a device group, the step channel, deaths."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import psutil
import pytest
import ray

import raydp
from raydp.errors import DeathCause, EngineDeadError, RaydpError, StartupError
from raydp.names import NAMESPACE
from raydp.testing.leftovers import ActorRow, actor_table
from tests.integration.engines import MissingWorkerEngine
from tests.integration.helpers import assert_nothing_left, socket_dirs, wait_until

ECHO_WORKERS = "raydp.models.echo_workers:WorkerEchoEngine"


def _title(pid: int) -> str:
    return " ".join(psutil.Process(pid).cmdline())


def _worker_actors_alive() -> list[ActorRow]:
    return [a for a in actor_table() if a.class_name == "WorkerActor" and a.state == "ALIVE"]


def _kill_when(cluster: raydp.Cluster, kill: Any) -> tuple[EngineDeadError, float]:
    killed_at = time.monotonic()
    kill()
    with pytest.raises(EngineDeadError) as info:  # watched: the progress watchdog would take 300 s
        cluster.wait(timeout=10)
    return info.value, time.monotonic() - killed_at


@pytest.mark.timeout(240)
def test_one_worker_per_device_bundle_forms_a_group_and_names_itself(two_nodes) -> None:  # type: ignore[no-untyped-def]
    with raydp.launch(name="wk", dp_size=2, tensor_parallel_size=2, engine=ECHO_WORKERS, progress=False) as cluster:
        client = cluster.client()
        assert [client.generate([7, 8], max_tokens=3) for _ in range(4)] == [[7, 8, 7]] * 4
        for rank in (0, 1):
            workers = client.call_utility(rank, "describe_workers")
            assert [w["tp_rank"] for w in workers] == [0, 1]
            # Ray gave each worker its own device, and only that one is visible to it.
            assert all(len(w["device_ids"]) == 1 and w["cuda_visible_devices"] == w["device_ids"][0] for w in workers)
            assert workers[0]["device_ids"] != workers[1]["device_ids"]
            assert all(w["steps"] > 0 for w in workers), "every worker ran the steps"
            node = cluster.endpoints.engines[rank].node_id
            for w in workers:
                want = f"raydp::wk dp{rank} tp{w['tp_rank']} node {node[:8]}"
                assert wait_until(lambda w=w, want=want: _title(w["pid"]).startswith(want), timeout=2), _title(w["pid"])
            # The workers of a rank form a real torch.distributed group.
            assert client.call_utility(rank, "worker_all_reduce", 1.5) == [3.0, 3.0]
        with pytest.raises(RaydpError) as info:
            client.call_utility(1, "fail_worker", "kaboom")
        text = str(info.value)
        assert "worker tp0 of rank 1" in text and "RuntimeError: kaboom" in text
        assert 'echo_workers.py", line' in text, "the worker's traceback comes back"
        assert client.generate([1], max_tokens=2) == [1, 1], "a worker's exception in a control call is not fatal"
    assert_nothing_left("wk")
    assert wait_until(lambda: not _worker_actors_alive(), timeout=15), _worker_actors_alive()


@pytest.mark.timeout(240)
def test_killing_a_worker_actor_fails_its_rank_at_once(two_nodes) -> None:  # type: ignore[no-untyped-def]
    with raydp.launch(
        name="wkill",
        dp_size=2,
        tensor_parallel_size=2,
        engine=ECHO_WORKERS,
        engine_kwargs={"step_delay_s": 0.005},
        progress=False,
    ) as cluster:
        client = cluster.client()
        workers = client.call_utility(1, "describe_workers")
        in_flight = client.submit([1, 2], max_tokens=1_000_000, rank=1)
        assert wait_until(lambda: client.call_utility(1, "stats")["steps"] > 2, timeout=10)
        err, latency = _kill_when(cluster, lambda: os.kill(workers[1]["pid"], signal.SIGKILL))
        print(f"\nworker death -> EngineDeadError after {latency * 1000:.0f} ms: {err}")
        assert err.rank == 1 and err.node_id == cluster.endpoints.engines[1].node_id
        assert "worker tp1 of rank 1" in str(err) and workers[1]["node_id"][:12] in str(err)
        with pytest.raises(RaydpError, match="worker tp1 of rank 1"):  # failed loudly, naming the worker
            in_flight.result(timeout=5)
        assert client.generate([3], max_tokens=2, rank=0) == [3, 3], "the other rank keeps serving"
    assert_nothing_left("wkill")
    assert wait_until(lambda: not _worker_actors_alive(), timeout=15), _worker_actors_alive()


@pytest.mark.timeout(240)
def test_ray_kill_of_a_worker_is_reported_as_killed_and_a_dense_restart_brings_workers_back(two_nodes) -> None:  # type: ignore[no-untyped-def]
    with raydp.launch(
        name="wrst", dp_size=1, tensor_parallel_size=2, engine=ECHO_WORKERS, max_restarts=1, progress=False
    ) as cluster:
        client = cluster.client()
        before = client.call_utility(0, "describe_workers")
        actor = next(a for a in _worker_actors_alive() if a.pid == before[0]["pid"])
        assert actor.name.startswith("wrst-dp0-tp0-"), "workers are named by cluster, DP rank and TP rank"
        ray.kill(ray.get_actor(actor.name, namespace=NAMESPACE), no_restart=True)
        assert wait_until(lambda: bool(cluster.deaths), timeout=20)  # event-driven; generous for a busy machine
        err = cluster.deaths[0]
        assert isinstance(err, EngineDeadError) and err.restarting
        assert err.cause is DeathCause.KILLED and "worker tp0 of rank 0" in str(err)
        assert wait_until(lambda: _serves(client), timeout=60), "the rank came back"
        after = client.call_utility(0, "describe_workers")
        assert {w["pid"] for w in after}.isdisjoint({w["pid"] for w in before}), "new workers"
        assert client.call_utility(0, "worker_all_reduce", 2.0) == [4.0, 4.0]
    assert_nothing_left("wrst")


@pytest.mark.timeout(240)
def test_a_worker_that_cannot_start_fails_launch_naming_it_and_leaves_nothing(two_nodes) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(StartupError) as info:
        raydp.launch(
            name="wbad",
            dp_size=1,
            tensor_parallel_size=2,
            engine=MissingWorkerEngine,
            progress=False,
            startup_timeout_s=60,
        )
    assert "raydp_nowhere.module:NoWorker" in str(info.value) and "cannot import" in str(info.value)
    assert_nothing_left("wbad")
    assert wait_until(lambda: not _worker_actors_alive(), timeout=15), _worker_actors_alive()


@pytest.mark.timeout(180)
def test_mp_engine_that_rejects_its_settings_fails_launch_and_ends_its_workers() -> None:
    with pytest.raises(StartupError, match="heads=3: must be divisible by tensor_parallel_size=2"):
        raydp.launch(
            name="mpwbad",
            dp_size=1,
            tensor_parallel_size=2,
            backend="mp",
            engine="raydp.models.tp_lm:TPLMEngine",
            engine_kwargs={"heads": 3, "dim": 48},
            progress=False,
        )
    assert wait_until(lambda: not _titled("raydp::mpwbad")), _titled("raydp::mpwbad")
    assert socket_dirs("mpwbad") == []


def _serves(client: Any) -> bool:
    try:
        return bool(client.generate([9], max_tokens=1, rank=0, timeout=5) == [9])
    except RaydpError:
        return False


# ---- the mp backend -----------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_mp_workers_serve_and_a_killed_worker_fails_its_rank_fast() -> None:
    cluster = raydp.launch(
        name="mpw",
        dp_size=2,
        tensor_parallel_size=2,
        backend="mp",
        engine=ECHO_WORKERS,
        engine_kwargs={"step_delay_s": 0.005},
        progress=False,
    )
    try:
        client = cluster.client()
        assert [client.generate([2, 3], max_tokens=3) for _ in range(4)] == [[2, 3, 2]] * 4
        workers = client.call_utility(1, "describe_workers")
        engine_pid = next(p.process.pid for p in cluster._manager.procs if p.rank == 1)
        for w in workers:
            assert psutil.Process(w["pid"]).ppid() == engine_pid, "workers are children of their engine"
            assert f"dp1 tp{w['tp_rank']}" in _title(w["pid"])
        # Held from before the kill: the failed rank may take its other workers down at once.
        survivors = [psutil.Process(w["pid"]) for w in workers[1:]]
        assert client.call_utility(1, "worker_all_reduce", 1.0) == [2.0, 2.0]
        in_flight = client.submit([1], max_tokens=1_000_000, rank=1)
        err, latency = _kill_when(cluster, lambda: os.kill(workers[0]["pid"], signal.SIGKILL))
        print(f"\nmp worker death -> EngineDeadError after {latency * 1000:.0f} ms: {err}")
        assert err.rank == 1 and err.cause is DeathCause.KILLED
        assert "worker tp0 of rank 1" in str(err) and "SIGKILL" in str(err)
        with pytest.raises(RaydpError, match="worker tp0 of rank 1"):
            in_flight.result(timeout=5)
        assert client.generate([5], max_tokens=1, rank=0) == [5]
    finally:
        cluster.close()
    assert wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in survivors))
    assert socket_dirs("mpw") == []


@pytest.mark.timeout(180)
def test_mp_workers_exit_soon_after_their_engine_is_sigkilled() -> None:
    cluster = raydp.launch(
        name="mpwk", dp_size=1, tensor_parallel_size=2, backend="mp", engine=ECHO_WORKERS, progress=False
    )
    try:
        client = cluster.client()
        workers = [psutil.Process(w["pid"]) for w in client.call_utility(0, "describe_workers")]
        engine = next(p.process for p in cluster._manager.procs if p.rank == 0)
        os.kill(engine.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        # They see their parent-death pipe close at once; the bound only has to outlast a busy 2-core
        # machine (2 s did not, beside another module), and the time it took is printed.
        assert wait_until(lambda: not any(_alive(p) for p in workers), timeout=30.0)
        print(f"\nworkers gone {time.monotonic() - killed_at:.2f}s after their engine's SIGKILL")
    finally:
        cluster.close()
    assert socket_dirs("mpwk") == []


@pytest.mark.timeout(180)
def test_mp_worker_ends_gracefully_on_sigterm() -> None:
    with raydp.launch(
        name="mpwt", dp_size=1, tensor_parallel_size=2, backend="mp", engine=ECHO_WORKERS, progress=False
    ) as cluster:
        client = cluster.client()
        workers = client.call_utility(0, "describe_workers")
        victim = next(p for p in cluster._manager.procs if p.rank == 0)
        del victim  # the engine stays; its worker is ended politely
        os.kill(workers[1]["pid"], signal.SIGTERM)
        with pytest.raises(EngineDeadError) as info:
            cluster.wait(timeout=10)
        assert "worker tp1 of rank 0" in str(info.value) and "exit code 0" in str(info.value)


def _titled(prefix: str) -> list[int]:
    """Live processes whose title starts with ``prefix``."""
    found = []
    for proc in psutil.process_iter():
        try:
            if " ".join(proc.cmdline()).startswith(prefix) and _alive(proc):
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
