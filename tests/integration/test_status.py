"""``raydp status`` from another process, and the coordinator's Ray metrics, on a real 2-node cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from typing import Any

import pytest
import ray

import raydp
from tests.integration.helpers import wait_until


def status(*args: str, address: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "RAYDP_LOG_LEVEL": "WARNING"}
    return subprocess.run(
        [sys.executable, "-m", "raydp", "status", "--address", address, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )


@pytest.mark.timeout(240)
def test_status_shows_ranks_devices_load_restarts_and_api_servers(two_nodes: Any) -> None:
    engine = {"prefix_cache_blocks": 64, "block_size": 16}  # echo engines that report a prefix cache
    with raydp.launch(name="stat", dp_size=3, max_restarts=1, progress=False, engine_kwargs=engine) as cluster:
        client = cluster.client()
        for _ in range(2):  # 32 tokens looked up twice on rank 0: found the second time
            client.generate(list(range(32)), max_tokens=1, rank=0)
        servers = cluster.serve_api(2, port=0)
        ray.kill(cluster._manager.engines[2], no_restart=True)
        # ray.kill returns before the process is gone, and on a busy machine the old engine may still answer
        # a request sent now, whose lookups its replacement then never reports. So the probe waits until the
        # coordinator has heard of the restart, and goes to the replacement.
        assert wait_until(lambda: cluster.coordinator_state().restarts == [0, 0, 1], timeout=60), "rank 2 restarted"
        assert wait_until(lambda: _serves(client, 2), timeout=60), "rank 2 came back"
        assert wait_until(lambda: cluster.coordinator_state().prefix_cache[0] == [64, 32], timeout=10)
        # The replacement's lookups (the probe's) reach the coordinator's picture.
        assert wait_until(lambda: cluster.coordinator_state().prefix_cache[2][0] > 0, timeout=10), (
            cluster.coordinator_state()
        )
        result = status("stat", "--json", address=two_nodes.address)
        assert result.returncode == 0, result.stderr
        (report,) = json.loads(result.stdout)
        assert report["name"] == "stat" and report["dp_size"] == 3
        nodes = {ep.rank: ep.node_id for ep in cluster.endpoints.engines}
        assert [r["node_id"] for r in report["ranks"]] == [nodes[0], nodes[1], nodes[2]]
        assert all(len(r["devices"]) == 1 for r in report["ranks"]), report["ranks"]  # one logical GPU each
        assert [r["restarts"] for r in report["ranks"]] == [0, 0, 1]
        assert [r["deaths"] for r in report["ranks"]] == [0, 0, 1]
        assert [r["hangs"] for r in report["ranks"]] == [0, 0, 0]  # killed, not hung
        assert all(r["state"] == "serving" for r in report["ranks"]) and report["health"] == "serving"
        assert [r["work"] for r in report["ranks"]] == [0, 0, 0]  # echo engines report work(); all idle
        # Every rank has spoken, and recently: a live rank speaks every second, and none was ended as frozen.
        assert all(r["silent_s"] is not None and 0.0 <= r["silent_s"] < 60 for r in report["ranks"]), report["ranks"]
        # Rank 1 looked nothing up; rank 2's probes after its restart have no full block to find.
        assert [r["prefix_cache_hit_rate"] for r in report["ranks"]] == [0.5, None, 0.0]
        (api,) = report["api_servers"]
        assert (api["url"], api["count"], api["mode"]) == (servers.url, 2, "internal")

        table = status(address=two_nodes.address)  # every running cluster, as a table
        assert table.returncode == 0, table.stderr
        assert "cluster stat: 3 ranks, dense" in table.stdout and servers.url in table.stdout
        assert any(
            line.startswith("cluster stat:") and line.endswith(", serving") for line in table.stdout.splitlines()
        )
        header = [
            "rank",
            "node",
            "devices",
            "waiting",
            "running",
            "work",
            "cache",
            "hits",
            "silent",
            "deaths",
            "hangs",
            "restarts",
            "state",
        ]
        assert any(line.split()[:1] == ["0"] and "50%" in line.split() for line in table.stdout.splitlines())
        assert any(line.split() == header for line in table.stdout.splitlines()), table.stdout


@pytest.mark.timeout(240)
def test_status_shows_each_ranks_pool_of_a_p_d_cluster_on_ray(two_nodes: Any) -> None:
    with raydp.launch(name="statpd", prefill_dp_size=1, decode_dp_size=2, progress=False) as cluster:
        client = cluster.client()
        handles = [client.submit([i, i + 1, i + 2], 4) for i in range(6)]
        assert [h.result(30) for h in handles] == [[i, i + 1, i + 2, i] for i in range(6)]
        assert {h.rank for h in handles} <= {1, 2}, "every stream ends on a decode rank"
        result = status("statpd", "--json", address=two_nodes.address)
        assert result.returncode == 0, result.stderr
        (report,) = json.loads(result.stdout)
        assert [r["pool"] for r in report["ranks"]] == ["prefill", "decode", "decode"]
        table = status("statpd", address=two_nodes.address).stdout
        assert "cluster statpd: 3 ranks, dense, P/D 1 prefill + 2 decode" in table, table
        rows = [line.split() for line in table.splitlines()]
        assert ["rank", "pool", "node"] in [row[:3] for row in rows], table
        assert [row[:2] for row in rows if row[:1] in (["0"], ["1"], ["2"])] == [
            ["0", "prefill"],
            ["1", "decode"],
            ["2", "decode"],
        ]


@pytest.mark.timeout(120)
def test_status_without_a_cluster_says_what_it_looked_for(two_nodes: Any) -> None:
    result = status("nosuch", address=two_nodes.address)
    assert len([line for line in result.stderr.splitlines() if "token authentication" in line.lower()]) == 1, (
        "the cluster's authentication mode, said once"
    )
    assert result.returncode == 1
    assert "'nosuch-coordinator'" in result.stderr and "namespace 'raydp'" in result.stderr


@pytest.mark.timeout(120)
def test_the_cli_names_the_clusters_authentication_mode_once_in_its_own_words() -> None:
    """A new local Ray turns token auth on; Ray's own warning about that is replaced by one raydp line."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    result = subprocess.run(
        [sys.executable, "-m", "raydp", "status", "--address", "local"],
        env={**env, "PYTHONPATH": os.getcwd()},
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert result.returncode == 1 and "no raydp cluster is running there" in result.stderr, result.stderr
    mode = [line for line in result.stderr.splitlines() if "token authentication" in line.lower()]
    assert len(mode) == 1 and mode[0].startswith("raydp status: Ray cluster: token authentication on"), mode


@pytest.mark.timeout(180)
def test_the_coordinator_and_engines_export_ray_metrics(two_nodes: Any) -> None:
    # Slow steps, so the long request is still running while the metrics are scraped.
    with raydp.launch(name="metr", dp_size=2, progress=False, engine_kwargs={"step_delay_s": 0.01}) as cluster:
        client = cluster.client()
        for _ in range(3):
            assert client.generate([5], max_tokens=2, rank=0) == [5, 5]
        pending = client.submit([1], max_tokens=1_000_000, rank=1)
        assert wait_until(lambda: cluster.coordinator_state().counts[1] == [0, 1], timeout=30), (
            cluster.coordinator_state()
        )
        nodes = {ep.rank: ep.node_id for ep in cluster.endpoints.engines}
        # Ray prefixes application metrics with ray_; each node's agent exports its own actors'.
        running = scrape_until(
            cluster.endpoints.coordinator.node_id, "ray_raydp_rank_running", 'rank="1"', lambda value: value == 1.0
        )
        finished = scrape_until(
            nodes[0], "ray_raydp_engine_requests", 'outcome="finished"', lambda value: value >= 3.0, also='rank="0"'
        )
        work = scrape_until(
            cluster.endpoints.coordinator.node_id, "ray_raydp_rank_work", 'rank="1"', lambda value: value > 900_000
        )  # the tokens the long request has left
        assert running == 1.0 and finished >= 3.0 and work <= 1_000_000
        assert not pending.done()  # what the gauge showed was this request, still running


def scrape_until(node_id: str, metric: str, tag: str, ok: Any, also: str = "", timeout: float = 60.0) -> float:
    """The first value of ``metric`` for cluster metr with ``tag`` that satisfies ``ok``, read from the node."""
    port = next(n["MetricsExportPort"] for n in ray.nodes() if n["NodeID"] == node_id)
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            lines = resp.read().decode().splitlines()
        seen = [
            line
            for line in lines
            if line.startswith(metric) and 'cluster="metr"' in line and tag in line and also in line
        ]
        for line in seen:
            value = float(line.rsplit(" ", 1)[1])
            if ok(value):
                return value
        time.sleep(1)
    raise AssertionError(f"{metric} {tag} never reached the expected value; last seen: {seen}")


def _serves(client: Any, rank: int) -> bool:
    try:
        return bool(client.generate([rank + 1], max_tokens=1, rank=rank, timeout=5) == [rank + 1])
    except raydp.RaydpError:
        return False
