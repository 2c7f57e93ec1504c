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
    return subprocess.run([sys.executable, "-m", "raydp", "status", "--address", address, *args],
                          env=env, capture_output=True, text=True, timeout=90, check=False)


@pytest.mark.timeout(240)
def test_status_shows_ranks_devices_load_restarts_and_api_servers(two_nodes: Any) -> None:
    with raydp.launch(name="stat", dp_size=3, max_restarts=1, progress=False) as cluster:
        client = cluster.client()
        servers = cluster.serve_api(2, port=0)
        ray.kill(cluster._manager.engines[2], no_restart=True)
        assert wait_until(lambda: _serves(client, 2), timeout=60), "rank 2 came back"
        result = status("stat", "--json", address=two_nodes.address)
        assert result.returncode == 0, result.stderr
        (report,) = json.loads(result.stdout)
        assert report["name"] == "stat" and report["dp_size"] == 3
        nodes = {ep.rank: ep.node_id for ep in cluster.endpoints.engines}
        assert [r["node_id"] for r in report["ranks"]] == [nodes[0], nodes[1], nodes[2]]
        assert all(len(r["devices"]) == 1 for r in report["ranks"]), report["ranks"]  # one logical GPU each
        assert [r["restarts"] for r in report["ranks"]] == [0, 0, 1]
        assert [r["deaths"] for r in report["ranks"]] == [0, 0, 1]
        assert all(r["state"] == "serving" for r in report["ranks"])
        (api,) = report["api_servers"]
        assert (api["url"], api["count"], api["mode"]) == (servers.url, 2, "internal")

        table = status(address=two_nodes.address)  # every running cluster, as a table
        assert table.returncode == 0, table.stderr
        assert "cluster stat: 3 ranks, dense" in table.stdout and servers.url in table.stdout


@pytest.mark.timeout(120)
def test_status_without_a_cluster_says_what_it_looked_for(two_nodes: Any) -> None:
    result = status("nosuch", address=two_nodes.address)
    assert result.returncode == 1
    assert "'nosuch-coordinator'" in result.stderr and "namespace 'raydp'" in result.stderr


@pytest.mark.timeout(180)
def test_the_coordinator_exports_per_rank_load_as_ray_metrics(two_nodes: Any) -> None:
    with raydp.launch(name="metr", dp_size=2, progress=False) as cluster:
        pending = cluster.client().submit([1], max_tokens=1_000_000, rank=1)
        coordinator_node = cluster.endpoints.coordinator.node_id
        port = next(n["MetricsExportPort"] for n in ray.nodes() if n["NodeID"] == coordinator_node)
        url = f"http://127.0.0.1:{port}/metrics"
        assert wait_until(lambda: cluster.coordinator_state()["counts"][1] == [0, 1], timeout=30), \
            cluster.coordinator_state()
        want = 'ray_raydp_rank_running{'  # Ray prefixes application metrics with ray_
        deadline = time.monotonic() + 60
        text = ""
        while time.monotonic() < deadline:
            with urllib.request.urlopen(url, timeout=10) as resp:
                text = resp.read().decode()
            if any(line.startswith(want) and 'cluster="metr"' in line and 'rank="1"' in line
                   and line.rstrip().endswith(" 1.0") for line in text.splitlines()):
                break
            time.sleep(1)
        else:
            raise AssertionError("rank 1's running request never showed in Ray's metrics:\n"
                                 + "\n".join(line for line in text.splitlines() if "raydp" in line))
        assert not pending.done()  # what the metric showed was this request, still running


def _serves(client: Any, rank: int) -> bool:
    try:
        return bool(client.generate([rank + 1], max_tokens=1, rank=rank, timeout=5) == [rank + 1])
    except raydp.RaydpError:
        return False
