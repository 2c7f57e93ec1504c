"""The seeded chaos soak on namespace hosts, half a minute: partitions too, and every request is accounted for.

Needs root and ``ip netns`` (skipped with the reason otherwise); the hosts
are network namespaces on 10.213.7.0/24 (:mod:`raydp.testing.netns`).
"""

from __future__ import annotations

import pytest

from raydp.testing import netns
from tests.integration.chaos_checks import BRISK, assert_requests_accounted, run_soak
from tests.integration.conftest import ClusterPool

KINDS = {
    "rank-sigkill",
    "rank-ray-kill",
    "rank-hang",
    "worker-sigkill",
    "coordinator-sigkill",
    "coordinator-ray-kill",
    "api-server-sigkill",
    "partition",
}


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(330)
def test_a_chaos_soak_on_namespace_hosts_survives_partitions_and_leaves_nothing(
    cluster_pool: ClusterPool,
) -> None:
    reason = netns.unavailable()
    if reason is not None:
        pytest.skip(f"namespace hosts unavailable: {reason}")
    cluster_pool.shutdown()  # the soak starts a Ray of its own; on 2 cores the shared one would only slow it down
    args = ["--seed", "3", "--minutes", "0.5", *BRISK, "--hosts", "netns"]
    summary = run_soak(args, KINDS, timeout_s=280, after=netns.teardown)  # teardown: had the soak been killed
    partitions = [f for f in summary["faults"] if f["kind"] == "partition"]
    assert partitions and all(f["detect_s"] < 30 for f in partitions), partitions
    assert_requests_accounted(summary)
    rss0, rss1 = summary["resources"]["driver_rss_mb"]
    fds0, fds1 = summary["resources"]["driver_fds"]
    assert rss1 <= 1.5 * rss0 + 64 and fds1 <= 1.5 * fds0 + 48, summary["resources"]
    assert summary["leftovers"] == [], "nothing left after close: no actor, process, namespace or link"
    assert netns.leftovers() == []
