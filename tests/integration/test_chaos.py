"""The seeded chaos soak, half a minute: every request is accounted for while every kind of fault hits the cluster.

Half a minute keeps the suite under its budget: the soak injects every kind once before any
random ones, and goes on past its minutes until each kind has hit (about 8 faults with this
seed); longer soaks are the same script with more ``--minutes``.
"""

from __future__ import annotations

import pytest

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
    "node-remove",
}


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(300)
def test_a_seeded_chaos_soak_loses_no_request_and_leaves_nothing(cluster_pool: ClusterPool) -> None:
    cluster_pool.shutdown()  # the soak starts a Ray of its own; on 2 cores the shared one would only slow it down
    summary = run_soak(["--seed", "7", "--minutes", "0.5", *BRISK], KINDS, timeout_s=280)
    assert_requests_accounted(summary)
    rss0, rss1 = summary["resources"]["driver_rss_mb"]
    fds0, fds1 = summary["resources"]["driver_fds"]
    assert rss1 <= 1.5 * rss0 + 64 and fds1 <= 1.5 * fds0 + 48, summary["resources"]
    assert summary["leftovers"] == [], "nothing left after close"
