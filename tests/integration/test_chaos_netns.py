"""The seeded chaos soak on namespace hosts, half a minute: partitions too, and every request is accounted for.

Needs root and ``ip netns`` (skipped with the reason otherwise); the hosts
are network namespaces on 10.213.7.0/24 (:mod:`raydp.testing.netns`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from raydp.testing import netns
from tests.integration.chaos_checks import assert_requests_accounted
from tests.integration.conftest import ClusterPool

ROOT = Path(__file__).resolve().parents[2]
BRISK = ["--warmup-s", "5", "--gap-s", "0.2", "1"]  # short pauses: the faults, not the waits, are the test
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
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "raydp.testing.chaos",
            "--seed",
            "3",
            "--minutes",
            "0.5",
            *BRISK,
            "--hosts",
            "netns",
            "--json",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=280)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the soak tears its hosts down on SIGTERM
        out, err = proc.communicate(timeout=40)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        netns.teardown()  # had the soak been killed outright
    tail = err[-6000:]
    assert out.strip(), f"no summary (exit code {proc.returncode}):\n{tail}"
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["violations"] == [], f"{summary['violations']}\n{tail}"
    assert proc.returncode == 0, tail
    assert set(summary["faults_by_kind"]) == KINDS, summary["faults_by_kind"]
    assert all(f["detect_s"] is not None and f["back_s"] is not None for f in summary["faults"])
    partitions = [f for f in summary["faults"] if f["kind"] == "partition"]
    assert partitions and all(f["detect_s"] < 30 for f in partitions), partitions
    assert_requests_accounted(summary)
    rss0, rss1 = summary["resources"]["driver_rss_mb"]
    fds0, fds1 = summary["resources"]["driver_fds"]
    assert rss1 <= 1.5 * rss0 + 64 and fds1 <= 1.5 * fds0 + 48, summary["resources"]
    assert summary["leftovers"] == [], "nothing left after close: no actor, process, namespace or link"
    assert netns.leftovers() == []
