"""Ray Jobs: `raydp demo` submitted through the Jobs API runs on the cluster; `ray job stop` ends it cleanly."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from raydp.testing.http_call import Call
from tests.integration.helpers import assert_nothing_left
from tests.integration.http_helpers import shutting_down

ROOT = Path(__file__).resolve().parents[2]
# `ray job stop` sends SIGTERM to the driver and every process under it, and
# SIGKILL after RAY_JOB_STOP_WAIT_TIME_S (3 s by default): the job's
# runtime_env sets it, as docs/cli.md advises, above serve's grace period.
STOP_WAIT_S = 60  # generous for a busy machine: a clean stop takes seconds, and a SIGKILL fails _clean_exit
JOB_ENV = {
    "PYTHONPATH": str(ROOT),
    "RAY_JOB_STOP_WAIT_TIME_S": str(STOP_WAIT_S),
    "RAYDP_ENGINE_KWARGS": json.dumps({"step_delay_s": 0.02}),
}  # the echo engine: 20 ms a step


@pytest.mark.timeout(300)  # may pay for a fresh Ray cluster, then a 200 s job deadline
def test_demo_runs_as_a_ray_job(two_nodes_with_dashboard: Any) -> None:
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


def _jobs() -> Any:
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(f"http://{ray._private.worker.global_worker.node.address_info['webui_url']}")


def _logs_once(client: Any, job_id: str, text: str, timeout: float = 120) -> str:
    from ray.job_submission import JobStatus

    deadline = time.monotonic() + timeout
    while text not in (logs := client.get_job_logs(job_id)):
        status = client.get_job_status(job_id)
        assert status in {JobStatus.PENDING, JobStatus.RUNNING} and time.monotonic() < deadline, f"{status}: {logs}"
        time.sleep(0.5)
    return str(logs)


def _stop(client: Any, job_id: str) -> float:
    """``ray job stop``; seconds until the job is STOPPED."""
    from ray.job_submission import JobStatus

    sent = time.monotonic()
    assert client.stop_job(job_id)
    while (status := client.get_job_status(job_id)) != JobStatus.STOPPED:
        assert status == JobStatus.RUNNING and time.monotonic() - sent < STOP_WAIT_S, status
        time.sleep(0.1)
    return time.monotonic() - sent


def _clean_exit(logs: str, command: str) -> None:
    assert f"raydp {command}: stopped by SIGTERM; everything was shut down" in logs, logs[-3000:]
    assert "Traceback" not in logs, logs[-3000:]


@pytest.mark.timeout(300)
def test_ray_job_stop_ends_a_serving_job_after_answering_its_requests(two_nodes_with_dashboard: Any) -> None:
    client = _jobs()
    name = "jobserve"
    job_id = client.submit_job(
        entrypoint=f"{sys.executable} -m raydp serve --name {name} --engine echo --dp-size 2 --api-servers 2 "
        "--port 0 --graceful-shutdown-s 2",
        runtime_env={"env_vars": JOB_ENV},
    )
    logs = _logs_once(client, job_id, "Ctrl-C to stop")
    host, port = logs.split(" at http://")[1].split(" ")[0].split(":")
    plain = Call((host, int(port)), "/v1/completions", {"model": name, "prompt": [1], "max_tokens": 100_000})
    stream = Call(
        (host, int(port)), "/v1/completions", {"model": name, "prompt": [2], "max_tokens": 100_000, "stream": True}
    )
    assert stream.started.wait(30)
    took = _stop(client, job_id)
    assert took < STOP_WAIT_S, f"STOPPED {took:.1f}s after ray job stop"
    for call in (plain, stream):
        call.join(timeout=10)
        assert call.error is None, repr(call.error)
    assert plain.status == 503 and shutting_down(json.loads(plain.data), 2), plain.data
    assert shutting_down(json.loads(stream.data.decode().rstrip().split("\n\n")[-1].removeprefix("data: ")), 2)
    _clean_exit(client.get_job_logs(job_id), "serve")
    assert_nothing_left(name, wait_sockets=True)


@pytest.mark.timeout(300)
def test_ray_job_stop_ends_a_running_demo_cleanly(two_nodes_with_dashboard: Any) -> None:
    client = _jobs()
    job_id = client.submit_job(
        entrypoint=f"{sys.executable} -m raydp demo --dp-size 2 --engine echo --requests 5000 --max-tokens 1000 "
        "--no-progress",
        runtime_env={"env_vars": JOB_ENV},
    )
    _logs_once(client, job_id, "launched 2 ranks")
    took = _stop(client, job_id)
    assert took < STOP_WAIT_S, f"STOPPED {took:.1f}s after ray job stop"
    _clean_exit(client.get_job_logs(job_id), "demo")
    assert_nothing_left("demo", wait_sockets=True)
