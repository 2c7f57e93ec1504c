"""Shared real Ray clusters for the integration tests.

Starting a multi-node ``ray.cluster_utils.Cluster`` costs ~10 s on a 2-core
machine, so one cluster of a given shape is kept for as many tests as want
that shape; asking for another shape (or a fresh one) shuts the old one down.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster

from raydp.testing.faults import LEAN_HEAD

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
Shape = tuple[int, ...]  # logical GPUs per node, head first

# Under pytest-xdist each worker keeps its own Rays and files: its own Ray temp dir (where "the latest
# cluster" of ray.init() and of the CLI's subprocesses is written), its own temp dir (raydp's socket
# directories, which the leftover checks list by cluster name), and its own ports for what a Ray head
# binds at fixed defaults (the dashboard, which only the Jobs tests start, and its agent, which serves
# the Jobs API). Without xdist nothing changes.
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
HEAD_PORTS: dict[str, int] = {}
if WORKER:
    _offset = 100 * (1 + int(WORKER.removeprefix("gw")))
    HEAD_PORTS = {
        "dashboard_port": 8265 + _offset,
        "dashboard_agent_listen_port": 52365 + _offset,
    }
    os.environ.setdefault("RAYDP_TEST_CACHE", os.path.join(tempfile.gettempdir(), "raydp-tests"))  # shared
    for _var, _dir in (("RAY_TMPDIR", f"/tmp/raydp-{WORKER}"), ("TMPDIR", f"/tmp/{WORKER}")):
        os.makedirs(_dir, exist_ok=True)
        os.environ[_var] = _dir
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again (kept short: socket paths live under it)


# Seconds each module took in a profiled run (scripts/tools/module_seconds.py makes the table). The README's
# test command runs this directory on two xdist workers a module at a time, handed out in collection order
# (--no-loadscope-reorder): longest first, so that neither worker starts a long module when the other is
# almost done. A module missing from the table counts as a median one.
MODULE_SECONDS: dict[str, float] = json.loads((Path(__file__).parent / "module_seconds.json").read_text())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here, median = Path(__file__).parent, statistics.median(MODULE_SECONDS.values())

    def order(item: pytest.Item) -> tuple[int, float]:  # other directories' tests first, as collected
        return (1, -MODULE_SECONDS.get(item.path.name, median)) if item.path.parent == here else (0, 0.0)

    items.sort(key=order)  # stable: each module's own order is kept


class ClusterPool:
    def __init__(self) -> None:
        self.cluster: Cluster | None = None
        self.key: tuple[Shape, bool] | None = None  # the kept cluster's shape, and whether it has a dashboard

    def get(self, shape: Shape, *, fresh: bool = False, cpus_per_node: int = 4, dashboard: bool = False) -> Cluster:
        """A cluster of ``shape``, the kept one where it fits; ``dashboard`` for tests that need one (Jobs)."""
        if self.cluster is not None and self.key == (shape, dashboard) and not fresh:
            return self.cluster
        self.shutdown()
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": cpus_per_node,
                "num_gpus": shape[0],
                **HEAD_PORTS,
                **LEAN_HEAD,
                "include_dashboard": dashboard,
            },
        )
        for gpus in shape[1:]:
            cluster.add_node(num_cpus=cpus_per_node, num_gpus=gpus)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster.wait_for_nodes()
        self.cluster, self.key = cluster, (shape, dashboard)
        return cluster

    def shutdown(self) -> None:
        if self.cluster is not None:
            ray.shutdown()
            self.cluster.shutdown()
        self.cluster = self.key = None


@pytest.fixture(scope="session")
def cluster_pool() -> Iterator[ClusterPool]:
    pool = ClusterPool()
    yield pool
    pool.shutdown()


@pytest.fixture(scope="module")
def two_nodes(cluster_pool: ClusterPool) -> Cluster:
    """Two nodes of 4 logical GPUs each, sharing one IP."""
    return cluster_pool.get((4, 4))


@pytest.fixture(scope="module")
def two_nodes_with_dashboard(cluster_pool: ClusterPool) -> Cluster:
    """:func:`two_nodes` with Ray's dashboard, which serves the Jobs API."""
    return cluster_pool.get((4, 4), dashboard=True)
