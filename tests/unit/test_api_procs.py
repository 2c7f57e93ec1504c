"""API server processes: they serve once started, and a start that fails says which and leaves nothing."""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import queue
import signal
import socket
import time
from pathlib import Path

import httpx
import psutil
import pytest

from raydp.errors import ComponentDeadError, DeathCause, ProcessDeadError, StartupError
from raydp.serve.processes import APIServerProcessManager
from raydp.serve.settings import ServerSettings
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint

pytestmark = pytest.mark.timeout(60)


def test_a_failed_start_releases_the_listening_port() -> None:
    endpoints = _endpoints()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    unpicklable = lambda: None  # noqa: E731 - the child's arguments cannot be sent: spawning fails
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        APIServerProcessManager(endpoints, 1, host="127.0.0.1", port=port, node_id=unpicklable)  # type: ignore[arg-type]
    gc.collect()
    with socket.create_server(("127.0.0.1", port)):  # EADDRINUSE if the failed manager kept it
        pass


def _endpoints() -> ClusterEndpoints:
    nowhere = ["tcp://127.0.0.1:9"]  # connected lazily by ZMQ, and no request is sent
    coordinator = CoordinatorEndpoints("n", nowhere, nowhere, nowhere)
    return ClusterEndpoints("api", [EngineEndpoint(0, "n", nowhere)], coordinator, lockstep=False)


def test_the_servers_answer_once_the_manager_returns() -> None:
    servers = APIServerProcessManager(_endpoints(), 2)
    try:
        assert all(proc.process.is_alive() for proc in servers.procs)
        reply = httpx.get(f"{servers.url}/health", timeout=30)
        assert reply.status_code == 200 and reply.json()["client_count"] == 2
        # A named semaphore (a multiprocessing Event) would outlive a SIGKILL of the whole tree in /dev/shm.
        assert [_named_semaphores(proc.process.pid) for proc in servers.procs] == [[], []]
    finally:
        servers.close()


def _named_semaphores(pid: int | None) -> list[str]:
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return sorted({line.split()[-1] for line in maps if "/dev/shm/sem." in line})


def test_a_server_that_cannot_start_fails_the_start_by_name_and_leaves_nothing(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("not a tokenizer")  # passes the settings' check, fails to load
    settings = ServerSettings(tokenizer=str(tmp_path))
    with pytest.raises(StartupError, match=r"API server api-api0 \(pid \d+\) exited .* before it served") as caught:
        APIServerProcessManager(_endpoints(), 1, settings=settings)
    assert "see its log" in str(caught.value)
    assert not [p for p in psutil.Process().children(recursive=True) if "api-api" in " ".join(p.cmdline())]


def test_a_server_not_serving_within_startup_timeout_s_fails_the_start() -> None:
    # No interpreter starts and imports in 10 ms, however fast the machine.
    with pytest.raises(StartupError, match=r"was not serving within startup_timeout_s=0.01"):
        APIServerProcessManager(_endpoints(), 1, settings=ServerSettings(startup_timeout_s=0.01))


def test_a_dead_server_is_reported_with_its_node_and_cause_and_respawned() -> None:
    deaths: queue.Queue[ComponentDeadError] = queue.Queue()
    servers = APIServerProcessManager(_endpoints(), 1, node_id="node-a", settings=ServerSettings(max_restarts=1))
    try:
        servers.on_death(deaths.put)
        victim = servers.procs[0].process.pid
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        death = deaths.get(timeout=30)
        assert isinstance(death, ProcessDeadError)
        assert (death.node_id, death.cause, death.restarting) == ("node-a", DeathCause.KILLED, True)
        assert f"pid {victim}" in str(death) and "on node node-a" in str(death) and "SIGKILL" in str(death)
        deadline = time.monotonic() + 30  # the death is reported first, then the successor spawned
        while servers.procs[0].process.pid == victim and time.monotonic() < deadline:
            time.sleep(0.05)
        assert servers.procs[0].process.pid != victim, "a successor was spawned"
        assert _health_answers(servers.url), "and serves on the same port"
    finally:
        servers.close()


def _health_answers(url: str, timeout_s: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                return True
        time.sleep(0.2)
    return False
