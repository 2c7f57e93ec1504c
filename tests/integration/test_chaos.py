"""The seeded chaos soak, half a minute: every request is accounted for while every kind of fault hits the cluster.

Half a minute keeps the suite under its budget: the soak injects every kind once before any
random ones, and goes on past its minutes until each kind has hit (about 8 faults with this
seed); longer soaks are the same script with more ``--minutes``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    "node-remove",
}


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(300)
def test_a_seeded_chaos_soak_loses_no_request_and_leaves_nothing(cluster_pool: ClusterPool) -> None:
    cluster_pool.shutdown()  # the soak starts a Ray of its own; on 2 cores the shared one would only slow it down
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own Ray, never an ambient one
    env |= {"PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "raydp.testing.chaos", "--seed", "7", "--minutes", "0.5", *BRISK, "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    tail = proc.stderr[-6000:]
    assert proc.stdout.strip(), f"no summary (exit code {proc.returncode}):\n{tail}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["violations"] == [], f"{summary['violations']}\n{tail}"
    assert proc.returncode == 0, tail
    assert set(summary["faults_by_kind"]) == KINDS, summary["faults_by_kind"]
    assert all(f["detect_s"] is not None and f["back_s"] is not None for f in summary["faults"])
    assert_requests_accounted(summary)
    rss0, rss1 = summary["resources"]["driver_rss_mb"]
    fds0, fds1 = summary["resources"]["driver_fds"]
    assert rss1 <= 1.5 * rss0 + 64 and fds1 <= 1.5 * fds0 + 48, summary["resources"]
    assert summary["leftovers"] == [], "nothing left after close"
