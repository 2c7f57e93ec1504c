"""Ray Jobs: `raydp demo` submitted through the Jobs API runs on the cluster."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import ray

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)  # may pay for a fresh Ray cluster, then a 200 s job deadline
def test_demo_runs_as_a_ray_job(two_nodes: Any) -> None:
    from ray.job_submission import JobStatus, JobSubmissionClient

    webui = ray._private.worker.global_worker.node.address_info["webui_url"]
    client = JobSubmissionClient(f"http://{webui}")
    job_id = client.submit_job(
        entrypoint=f"{sys.executable} -m raydp demo --dp-size 2 --requests 50 --engine echo --no-progress",
        # The checkout is on this host's disk: point the job at it. (Shipping it as a
        # working_dir is what scripts/submit_job.py does for remote clusters; here Ray's
        # packaging once lost a file mid-run, which is Ray's flake, not raydp's.)
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
    )
    deadline = time.monotonic() + 200
    while client.get_job_status(job_id) not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
        assert time.monotonic() < deadline, client.get_job_logs(job_id)
        time.sleep(1)
    logs = client.get_job_logs(job_id)
    assert client.get_job_status(job_id) == JobStatus.SUCCEEDED, logs
    assert "total: 50 requests" in logs
    assert "launched 2 ranks" in logs
