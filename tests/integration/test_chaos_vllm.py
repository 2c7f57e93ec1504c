"""The seeded chaos soak on real vLLM engines: two minutes of faults, and every answer is the unbroken run's.

Two ranks of vLLM's engine core on the small model, two API servers running
vLLM's own front-end, a driver's load and an HTTP load of greedy requests.
Each prompt was answered once before any fault; every answer during the soak
(a stream that moved to another rank when its rank died or hung included)
must equal that answer, and every request is accounted for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from raydp.testing.chaos_vllm import VLLM_KINDS
from tests.integration.chaos_checks import assert_requests_accounted
from tests.integration.conftest import ClusterPool
from tests.integration.vllm_helpers import tiny_model

ROOT = Path(__file__).resolve().parents[2]
BRISK = ["--warmup-s", "5", "--gap-s", "0.2", "1"]  # short pauses: the faults, not the waits, are the test


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(1200)
def test_a_two_minute_vllm_chaos_soak_answers_every_request_as_the_unbroken_run(cluster_pool: ClusterPool) -> None:
    cluster_pool.shutdown()  # the soak starts a Ray of its own; on 2 cores the shared one would only slow it down
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1"}
    cmd = ["--seed", "11", "--minutes", "2", *BRISK, "--hosts", "vllm", "--model", str(tiny_model()), "--json"]
    proc = subprocess.run(
        [sys.executable, "-m", "raydp.testing.chaos", *cmd],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1100,
        check=False,
    )
    tail = proc.stderr[-6000:]
    assert proc.stdout.strip(), f"no summary (exit code {proc.returncode}):\n{tail}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["violations"] == [], f"{summary['violations']}\n{tail}"
    assert proc.returncode == 0, tail
    assert set(summary["faults_by_kind"]) == set(VLLM_KINDS), summary["faults_by_kind"]
    assert all(f["detect_s"] is not None and f["back_s"] is not None for f in summary["faults"])
    # Every answer equalled the unbroken run's ("wrong" is 0), the streams a fault moved among them.
    assert_requests_accounted(summary, least_ok=30)
    print(f"\nvLLM chaos soak: the driver's client moved {summary['requests']['driver_stream_moves']} streams")
    assert summary["leftovers"] == [], "nothing left after close"
