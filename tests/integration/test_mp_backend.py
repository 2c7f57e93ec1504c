"""The multiprocessing backend: DP=2 as local processes, no Ray."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest

import raydp
from raydp.errors import DeathCause, EngineDeadError
from raydp.fork_server import gpu_driver_present
from tests.integration.helpers import socket_dirs, wait_until


@pytest.mark.timeout(120)
def test_mp_dp2_serves_on_its_own_devices_and_a_sigkill_is_reported() -> None:
    cluster = raydp.launch(name="mpdp", dp_size=2, backend="mp", progress=False, engine_kwargs={"step_delay_s": 0.005})
    procs = cluster._manager.procs
    try:
        client = cluster.client()
        handles = [client.submit([i], max_tokens=3) for i in range(40)]
        assert [h.result(timeout=30) for h in handles] == [[i] * 3 for i in range(40)]
        assert {h.rank for h in handles} == {0, 1}
        assert cluster.capacity == 2 * 256
        seen = [client.call_utility(r, "describe") for r in (0, 1)]
        assert [(d["device_ids"], d["cuda_visible_devices"]) for d in seen] == [(["0"], "0"), (["1"], "1")]
        victim = next(p for p in procs if p.rank == 1)
        pending = client.submit([1], max_tokens=1_000_000, rank=1)
        assert wait_until(lambda: client.in_flight() == [0, 1], timeout=10), client.in_flight()
        killed_at = time.monotonic()
        os.kill(victim.process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError) as info:
            cluster.wait(timeout=10)
        print(f"\nmp backend: EngineDeadError after {(time.monotonic() - killed_at) * 1000:.0f} ms: {info.value}")
        assert info.value.rank == 1
        assert info.value.cause is DeathCause.KILLED
        assert "SIGKILL" in str(info.value) and str(victim.process.pid) in str(info.value)
        with pytest.raises(EngineDeadError):
            pending.result(timeout=5)
        assert client.in_flight() == [0, 0], "its failed request no longer counts"
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

    def stopped() -> bool:
        # The handle and the client it made hold each other: only a collection frees them, and one that
        # runs while the client's IO thread still has it in a frame finds them reachable. A program's
        # collector runs again; here each poll runs it.
        gc.collect()
        return not any(p.process.is_alive() for p in procs)

    assert wait_until(stopped, timeout=20)
    assert socket_dirs("mpgc") == []


@pytest.mark.timeout(120)
def test_abort_finishes_the_handle_and_frees_the_engine() -> None:
    with raydp.launch(
        name="mpabort", dp_size=1, backend="mp", progress=False, engine_kwargs={"step_delay_s": 0.001}
    ) as cluster:
        client = cluster.client()
        handle = client.submit([8], max_tokens=10**7, request_id="long")
        first = next(handle.stream(timeout=10))
        assert first == [8]
        client.abort("long")
        tokens = handle.result(timeout=10)
        assert handle.finish_reason == "abort" and tokens[:1] == [8]
        idle = lambda: cluster.coordinator_state().counts[0] == [0, 0]  # noqa: E731
        assert wait_until(idle, timeout=10), "the engine dropped the request"
        # The id is free again once the abort went through.
        assert client.generate([9], max_tokens=1, request_id="long") == [9]


@pytest.mark.timeout(120)
def test_a_killed_rank_restarts_while_max_restarts_allows_then_stays_dead() -> None:
    with raydp.launch(
        name="mprestart", dp_size=2, backend="mp", max_restarts=1, progress=False, engine_kwargs={"step_delay_s": 0.002}
    ) as cluster:
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
        assert wait_until(lambda: cluster.coordinator_state().restarts == [0, 1], timeout=10)
        assert client.generate([6], max_tokens=1, rank=0) == [6], "rank 0 served throughout"

        os.kill(second.process.pid, signal.SIGKILL)  # no restarts left
        assert wait_until(lambda: len(cluster.deaths) == 2, timeout=10)
        assert not cluster.deaths[-1].restarting  # type: ignore[attr-defined]
        with pytest.raises(EngineDeadError):
            client.generate([7], max_tokens=1, rank=1, timeout=10)
        time.sleep(1.0)
        # No third process: it stays dead (and what is left of the second, if anything, is ended).
        assert all(p.process.pid == second.process.pid for p in cluster._manager.procs if p.rank == 1)
    assert socket_dirs("mprestart") == []


@pytest.mark.timeout(300)
def test_mp_scales_2_3_1_2_under_load_and_loses_nothing() -> None:
    """The mp backend runs the same scale sequence as Ray's, on this node."""
    cluster = raydp.launch(
        name="mpscale", dp_size=2, backend="mp", progress=False, engine_kwargs={"step_delay_s": 0.002}
    )
    stop = threading.Event()
    outcomes: list[tuple[int | None, str]] = []  # (rank, "ok" or what went wrong), in order

    def send(client: raydp.Client) -> None:
        while not stop.is_set():
            handle = client.submit([7, 8], max_tokens=4)
            try:
                ok = handle.result(timeout=30) == [7, 8, 7, 8]
                outcomes.append((handle.rank, "ok" if ok else "wrong tokens"))
            except Exception as exc:
                outcomes.append((handle.rank, repr(exc)))

    senders = [threading.Thread(target=send, args=(cluster.client(),), daemon=True) for _ in range(2)]
    seen: set[int] = set()
    try:
        for thread in senders:
            thread.start()
        for size in (3, 1, 2):
            cluster.scale(size, drain_timeout_s=20)
            procs = cluster._manager.procs
            seen |= {p.process.pid for p in procs if p.process.pid is not None}
            assert cluster.dp_size == size and cluster.coordinator_state().dp_size == size
            assert sorted(p.rank for p in procs if p.rank is not None and p.process.is_alive()) == list(range(size))
            mark, wanted = len(outcomes), set(range(size))
            ran_on_all = lambda mark=mark, wanted=wanted: {r for r, o in outcomes[mark:] if o == "ok"} == wanted  # noqa: E731
            assert wait_until(ran_on_all, timeout=30), (
                f"after scaling to {size}, requests ran on {sorted({r for r, _ in outcomes[mark:]})}"
            )
        stop.set()
        for thread in senders:
            thread.join(timeout=60)
            assert not thread.is_alive(), "a request hung"
    finally:
        stop.set()
        cluster.close()
    bad = [o for o in outcomes if o[1] != "ok"]
    assert not bad, f"{len(bad)} of {len(outcomes)} requests failed: {bad[:5]}"
    assert len(outcomes) > 50, "the load barely ran"
    assert wait_until(
        lambda: not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in seen), timeout=20
    )
    assert socket_dirs("mpscale") == []


@pytest.mark.timeout(300)
def test_mp_autoscales_up_under_a_load_step_and_back_down_when_it_falls() -> None:
    """The autoscaler reads the coordinator's load and scales through the same sequence as scale()."""
    scaling = {
        "min_dp_size": 1,
        "max_dp_size": 3,
        "target_ongoing_requests": 2,
        "upscale_delay_s": 1.0,
        "downscale_delay_s": 2.0,
        "look_back_s": 1.0,
        "interval_s": 0.2,
        "drain_timeout_s": 10.0,
    }
    cluster = raydp.launch(
        name="mpauto",
        dp_size=1,
        backend="mp",
        progress=False,
        autoscaling=scaling,
        engine_kwargs={"step_delay_s": 0.01},
    )
    stop = threading.Event()
    outcomes: list[str] = []

    def send(client: raydp.Client) -> None:
        while not stop.is_set():
            handle = client.submit([3], max_tokens=20)
            try:
                outcomes.append("ok" if handle.result(timeout=60) == [3] * 20 else "wrong tokens")
            except Exception as exc:
                outcomes.append(repr(exc))

    senders = [threading.Thread(target=send, args=(cluster.client(),), daemon=True) for _ in range(6)]
    try:
        assert cluster.dp_size == 1
        for thread in senders:
            thread.start()
        # 6 requests always in flight, 2 per rank wanted: 3 ranks, the maximum.
        assert wait_until(lambda: cluster.coordinator_state().dp_size == 3, timeout=60), cluster.coordinator_state()
        assert wait_until(lambda: cluster.dp_size == 3, timeout=30)
        stop.set()
        for thread in senders:
            thread.join(timeout=60)
            assert not thread.is_alive(), "a request hung"
        # No load: back to the minimum once the downscale delay has passed.
        assert wait_until(lambda: cluster.coordinator_state().dp_size == 1, timeout=60), cluster.coordinator_state()
        assert cluster.client().generate([4], max_tokens=2) == [4, 4]
        runtime = cluster._manager.runtime
        assert wait_until(lambda: runtime.autoscale is not None and runtime.autoscale.current == 1, timeout=30)
        assert runtime.autoscale.desired == 1 and "ongoing requests" in runtime.autoscale.reason
    finally:
        stop.set()
        cluster.close()
    bad = [o for o in outcomes if o != "ok"]
    assert not bad, f"{len(bad)} of {len(outcomes)} requests failed: {bad[:5]}"
    assert socket_dirs("mpauto") == []


FORK_SERVER_KILLED = textwrap.dedent(
    """
    import json, time

    import psutil

    import raydp
    from tests.unit.test_child_context import fork_servers


    def main() -> None:
        engine = "tests.integration.engines:PreloadingEchoEngine"
        cluster = raydp.launch(name="mpfork", dp_size=2, backend="mp", max_restarts=1, progress=False, engine=engine)
        client = cluster.client()
        assert client.generate([1], max_tokens=1) == [1]
        procs = list(cluster._manager.procs)
        [server] = fork_servers()
        server.kill()
        deadline = time.monotonic() + 60
        while len(cluster.deaths) < 2 and time.monotonic() < deadline:  # the old ranks may answer until then
            time.sleep(0.05)
        serving = []
        while len(serving) < 2 and time.monotonic() < deadline:
            serving = []
            for rank in (0, 1):
                try:
                    serving.append(client.generate([rank + 2], max_tokens=1, rank=rank, timeout=5))
                except (raydp.RaydpError, TimeoutError):  # dead, or not back yet
                    time.sleep(0.1)
        deaths = [(type(d).__name__, d.cause.value, d.restarting, str(d)) for d in cluster.deaths]
        successors = [p for p in cluster._manager.procs if p not in procs]
        cluster.close()
        left = [p.name for p in procs + successors if runs(p.process.pid)]
        forked = {p.name: p.started is not None for p in procs}
        seen = {"forked": forked, "deaths": deaths, "serving": serving, "left": left}
        print(json.dumps({**seen, "successors_forked": [p.started is not None for p in successors]}))


    def runs(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


    if __name__ == "__main__":
        main()
    """
)


@pytest.mark.timeout(120)
@pytest.mark.skipif(gpu_driver_present(), reason="a GPU driver is present: children are spawned, no fork server")
def test_a_killed_fork_server_takes_only_its_ranks_which_restart() -> None:
    # In a fresh interpreter: a process has one fork server, and this one's may serve other tests' clusters.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(
        [sys.executable, "-c", FORK_SERVER_KILLED], capture_output=True, text=True, timeout=100, check=False, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["forked"] == {"mpfork-coordinator": False, "mpfork-dp0": True, "mpfork-dp1": True}, seen["forked"]
    assert sorted(d[:3] for d in seen["deaths"]) == [["EngineDeadError", "killed", True]] * 2, seen["deaths"]
    assert all("fork server died" in d[3] and "SIGKILL" in d[3] for d in seen["deaths"]), seen["deaths"]
    assert seen["serving"] == [[2], [3]], "both ranks serve again, forked from a new server"
    assert seen["successors_forked"] == [True, True], "each rank's successor forked from a new fork server"
    assert seen["left"] == [], "no process is left after close(), old or new"
    assert socket_dirs("mpfork") == []
