"""N API server processes share one socket; each is a client of its index."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

import raydp
from raydp.errors import ProcessDeadError
from raydp.serve.settings import ServerSettings
from tests.integration.helpers import running, wait_until


def post(url: str, payload: dict[str, object]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, json.dumps(payload).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def get(url: str) -> dict[str, object]:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return dict(json.loads(resp.read()))


def indexes_served(url: str, want: int, timeout_s: float = 60) -> set[object]:
    indexes: set[object] = set()
    deadline = time.monotonic() + timeout_s
    while len(indexes) < want and time.monotonic() < deadline:
        try:
            health = get(f"{url}/health")
        except (urllib.error.URLError, ConnectionError):
            continue  # a connection the dead server had accepted but never answered
        assert health["status"] == "ok" and health["client_count"] == want
        indexes.add(health["client_index"])
    return indexes


@pytest.mark.timeout(120)
def test_three_api_servers_share_a_port_and_a_dead_one_is_respawned() -> None:
    with raydp.launch(name="apis", dp_size=2, backend="mp", progress=False) as cluster:
        servers = cluster.serve_api(3, settings=ServerSettings(max_restarts=1))
        assert indexes_served(servers.url, 3) == {0, 1, 2}, "every process accepts on the one shared socket"
        status, body = post(f"{servers.url}/v1/generate", {"prompt_token_ids": [5, 6], "max_tokens": 4})
        assert (status, body) == (200, {"token_ids": [5, 6, 5, 6]})
        status, body = post(f"{servers.url}/v1/generate", {"prompt_token_ids": [1], "max_tokens": 0})
        error = body["error"]
        assert status == 400 and set(error) == {"message", "type", "param", "code"}, "OpenAI's error shape"
        assert error["param"] == "max_tokens" and str(error["message"]).startswith("max_tokens=0:")
        status, body = post(f"{servers.url}/v1/generate", {"prompt_token_ids": "x"})
        assert status == 400 and body["error"]["param"] == "prompt_token_ids"
        victim = servers.procs[1]
        os.kill(victim.process.pid, signal.SIGKILL)
        # The others keep serving on the shared socket while index 1 is spawned again.
        assert post(f"{servers.url}/v1/generate", {"prompt_token_ids": [7], "max_tokens": 2}) == (
            200,
            {"token_ids": [7, 7]},
        )
        respawned = wait_until(
            lambda: bool(cluster.deaths) and servers.procs[1].process.pid != victim.process.pid, timeout=30
        )
        assert respawned, "the death was reported and index 1 spawned again"
        assert cluster.wait(timeout=2) is None, "a respawned server does not end wait()"
        death = cluster.deaths[0]
        assert isinstance(death, ProcessDeadError) and death.restarting and victim.name in str(death)
        assert servers.procs[1].process.pid != victim.process.pid
        assert indexes_served(servers.url, 3) == {0, 1, 2}, "the successor took index 1"
        # The policy allowed one respawn: the next death is final.
        victim = servers.procs[1]
        os.kill(victim.process.pid, signal.SIGKILL)
        with pytest.raises(ProcessDeadError, match=f"{victim.name}.*SIGKILL|{victim.name}.*-9"):
            cluster.wait(timeout=10)
    assert not any(p.process.is_alive() for p in servers.procs)


@pytest.mark.timeout(120)
def test_api_servers_hear_of_a_dead_rank_from_the_coordinator() -> None:
    import threading

    with raydp.launch(
        name="apidead", dp_size=2, backend="mp", progress=False, engine_kwargs={"step_delay_s": 0.01}
    ) as cluster:
        servers = cluster.serve_api(2)
        assert post(f"{servers.url}/v1/generate", {"prompt_token_ids": [1], "max_tokens": 1, "rank": 1})[0] == 200
        stuck: list[tuple[int, dict[str, Any]]] = []
        worker = threading.Thread(
            target=lambda: stuck.append(
                post(f"{servers.url}/v1/generate", {"prompt_token_ids": [1], "max_tokens": 100_000, "rank": 1})
            )
        )
        worker.start()
        time.sleep(0.5)
        victim = next(p for p in cluster._manager.procs if p.rank == 1)
        os.kill(victim.process.pid, signal.SIGKILL)
        worker.join(timeout=30)
        assert stuck and stuck[0][0] == 503, stuck
        assert "rank 1" in stuck[0][1]["error"]["message"]
        # New requests go to the live rank; pinning the dead one fails fast.
        for _ in range(6):
            assert post(f"{servers.url}/v1/generate", {"prompt_token_ids": [2], "max_tokens": 2}) == (
                200,
                {"token_ids": [2, 2]},
            )
        status, body = post(f"{servers.url}/v1/generate", {"prompt_token_ids": [2], "max_tokens": 2, "rank": 1})
        assert status == 503 and "rank 1" in body["error"]["message"]


@pytest.mark.timeout(120)
def test_serving_api_servers_keep_their_dropped_cluster_and_it_closes_once_they_go() -> None:
    import gc

    cluster = raydp.launch(name="apikeep", dp_size=1, backend="mp", progress=False)
    pid = cluster.client().call_utility(0, "describe")["pid"]
    servers = cluster.serve_api(1)
    del cluster
    gc.collect()
    assert post(f"{servers.url}/v1/generate", {"prompt_token_ids": [3], "max_tokens": 2}) == (
        200,
        {"token_ids": [3, 3]},
    ), "API servers that serve keep their cluster, as a client does"
    del servers
    gc.collect()
    assert wait_until(lambda: not running(pid), timeout=30), "with nothing held, the cluster closed"
