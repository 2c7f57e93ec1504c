"""A detached cluster heals and scales without its launcher: its supervision runs inside the cluster."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from typing import Any

import pytest
import ray

import raydp
from raydp.testing.fault_load import echo_moves
from tests.integration.helpers import assert_nothing_left, live_actors, wait_until

NAME = "healer"
LAUNCHER = """
import ray, raydp
ray.init(address={address!r})
cluster = raydp.launch(name={name!r}, dp_size=2, detached=True, max_restarts=3, progress=False,
                       engine_kwargs={{"step_delay_s": 0.002}})
print("launched", cluster.dp_size, flush=True)
"""


def _engine_pid(rank: int) -> int:
    actor = ray.get_actor(f"{NAME}-dp{rank}", namespace="raydp")
    return int(ray.get(actor.wait_for_init.remote(), timeout=30)["pid"])


def _state_or_none(cluster: raydp.Cluster) -> Any:
    try:
        return cluster.coordinator_state()
    except Exception:  # the coordinator is down or its successor is starting
        return None


def _pinned(client: Any, prompt: list[int], rank: int) -> list[int] | None:
    """The tokens of a request pinned to ``rank``, or None while this client still knows it dead."""
    try:
        return list(client.generate(prompt, max_tokens=2, rank=rank, timeout=60))
    except raydp.EngineDeadError:
        return None


@pytest.mark.timeout(400)
def test_a_detached_cluster_heals_and_scales_after_its_launcher_exited(two_nodes: Any) -> None:
    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "RAY_ADDRESS": address}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(args, env=env, capture_output=True, text=True, timeout=150, check=False)

    out = run(sys.executable, "-c", LAUNCHER.format(address=address, name=NAME))
    assert out.returncode == 0 and "launched 2" in out.stdout, out.stderr[-3000:]
    stop = threading.Event()
    outcomes: list[str] = []
    try:
        # The launcher has exited: what is left is the cluster and its supervisor.
        assert sorted(live_actors(NAME)) == [f"{NAME}-coordinator", f"{NAME}-dp0", f"{NAME}-dp1", f"{NAME}-supervisor"]
        cluster = raydp.attach(NAME)
        client = cluster.client()

        def load() -> None:
            while not stop.is_set():
                handle = client.submit([7, 8], max_tokens=4, retryable=True, migratable=True)
                try:
                    got = handle.result(timeout=60)
                    # A stream cut by the kill goes on from its last token: the echo of its continuation.
                    outcomes.append("ok" if echo_moves([7, 8], 4, got) is not None else f"wrong tokens {got}")
                except Exception as exc:
                    outcomes.append(repr(exc))

        sender = threading.Thread(target=load, daemon=True)
        sender.start()

        # A SIGKILLed rank comes back, restarted by the supervisor, while this client serves on.
        old_pid = _engine_pid(1)
        os.kill(old_pid, signal.SIGKILL)
        assert wait_until(
            lambda: (s := _state_or_none(cluster)) is not None and s.restarts[1] == 1 and not s.dead, timeout=90
        ), _state_or_none(cluster)
        assert _engine_pid(1) != old_pid
        # The client hears of the restart with the coordinator's next snapshot: a request pinned to
        # the rank before that fails typed, as the rank was dead for all this client knew.
        assert wait_until(lambda: _pinned(client, [3], rank=1) == [3, 3], timeout=30)

        # A killed coordinator comes back at its addresses; the attached client is served.
        ray.kill(ray.get_actor(f"{NAME}-coordinator", namespace="raydp"), no_restart=True)
        assert wait_until(lambda: _state_or_none(cluster) is not None, timeout=90)
        assert client.generate([4], max_tokens=2, timeout=60) == [4, 4]

        # raydp scale works without the launcher; raydp status shows the restart.
        out = run(sys.executable, "-m", "raydp", "scale", NAME, "3")
        assert out.returncode == 0 and f"{NAME}: 2 -> 3 ranks" in out.stdout, out.stderr[-3000:]
        assert wait_until(lambda: client.generate([5], max_tokens=1, rank=2, timeout=30) == [5], timeout=60)
        out = run(sys.executable, "-m", "raydp", "status", NAME, "--json")
        assert out.returncode == 0, out.stderr[-3000:]
        (status,) = json.loads(out.stdout)
        assert status["dp_size"] == 3
        assert [r["restarts"] for r in status["ranks"]] == [0, 1, 0]
        assert [r["state"] for r in status["ranks"]] == ["serving"] * 3
        stop.set()
        sender.join(timeout=90)
        assert not sender.is_alive(), "a request hung"
        cluster.close()
        assert f"{NAME}-supervisor" in live_actors(NAME), "closing an attached handle leaves the cluster running"
    finally:
        stop.set()
        raydp.attach(NAME).shutdown()
    assert_nothing_left(NAME, timeout=30)
    bad = [o for o in outcomes if o != "ok"]
    assert not bad, f"{len(bad)} of {len(outcomes)} requests failed: {bad[:3]}"
    assert len(outcomes) > 20, "the load barely ran"


SCALER = "scaler"
AUTOSCALED_LAUNCHER = """
import ray, raydp
ray.init(address={address!r})
scaling = raydp.AutoscalingConfig(min_dp_size=1, max_dp_size=2, target_ongoing_requests=1.0, upscale_delay_s=0.2,
                                  downscale_delay_s=2.0, look_back_s=0.5, interval_s=0.1)
cluster = raydp.launch(name={name!r}, dp_size=1, detached=True, autoscaling=scaling, progress=False,
                       engine_kwargs={{"step_delay_s": 0.01, "max_running": 2}})
print("launched", cluster.dp_size, flush=True)
"""


@pytest.mark.timeout(400)
def test_a_detached_cluster_autoscales_after_its_launcher_exited(two_nodes: Any) -> None:
    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "RAY_ADDRESS": address}
    out = subprocess.run(
        [sys.executable, "-c", AUTOSCALED_LAUNCHER.format(address=address, name=SCALER)],
        env=env,
        capture_output=True,
        text=True,
        timeout=150,
        check=False,
    )
    assert out.returncode == 0 and "launched 1" in out.stdout, out.stderr[-3000:]
    stop = threading.Event()
    outcomes: list[str] = []
    try:
        cluster = raydp.attach(SCALER)
        client = cluster.client()

        def load() -> None:  # 6 requests of ~0.5 s in flight on 2-slot ranks: 3 per rank wanted at size 1
            while not stop.is_set():
                handles = [client.submit([9], max_tokens=50, retryable=True) for _ in range(6)]
                for handle in handles:
                    try:
                        outcomes.append("ok" if handle.result(timeout=60) == [9] * 50 else "wrong tokens")
                    except Exception as exc:
                        outcomes.append(repr(exc))

        sender = threading.Thread(target=load, daemon=True)
        sender.start()
        # The supervisor's autoscaler, not a launcher, grows the cluster under the load...
        assert wait_until(lambda: (s := _state_or_none(cluster)) is not None and s.dp_size == 2, timeout=120), (
            _state_or_none(cluster)
        )
        stop.set()
        sender.join(timeout=90)
        assert not sender.is_alive(), "a request hung"
        # ...and drains it back to the minimum once the load is gone.
        assert wait_until(lambda: (s := _state_or_none(cluster)) is not None and s.dp_size == 1, timeout=120), (
            _state_or_none(cluster)
        )
        status = subprocess.run(
            [sys.executable, "-m", "raydp", "status", SCALER, "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
            check=False,
        )
        assert status.returncode == 0, status.stderr[-3000:]
        (report,) = json.loads(status.stdout)
        assert report["dp_size"] == 1 and report["autoscale"]["current"] == 1, report
        cluster.close()
    finally:
        stop.set()
        raydp.attach(SCALER).shutdown()
    assert_nothing_left(SCALER, timeout=30)
    bad = [o for o in outcomes if o != "ok"]
    assert not bad, f"{len(bad)} of {len(outcomes)} requests failed: {bad[:3]}"
    assert len(outcomes) >= 6, "the load barely ran"


@pytest.mark.timeout(180)
def test_a_dropped_handle_of_a_detached_cluster_stops_watching_it_and_leaves_it_serving(two_nodes: Any) -> None:
    """The launcher polls the supervisor for deaths to tell its handle; once the handle is gone, nobody is
    left to tell, and a notebook that dropped it must not poll a cluster forever."""
    import gc

    name = "dropsup"
    cluster = raydp.launch(name=name, dp_size=1, detached=True, progress=False)
    try:
        assert cluster.client().generate([2], max_tokens=1, timeout=60) == [2]

        watch = cluster._manager._watcher  # this handle's own death watch
        assert watch is not None and watch.is_alive(), "deaths are watched while the handle lives"
        del cluster
        gc.collect()
        assert wait_until(lambda: not watch.is_alive(), timeout=30), "the watch ended with the handle"
        assert raydp.attach(name).client().generate([3], max_tokens=1, timeout=60) == [3], "a detached one serves on"
    finally:
        raydp.attach(name).shutdown()
    assert_nothing_left(name, timeout=30)
