#!/usr/bin/env python3
"""Submit a raydp job to a Ray cluster through the Ray Jobs API and follow its logs.

    python scripts/submit_job.py --address http://<head>:8265 -- python -m raydp demo --dp-size 4

The repository is shipped as the job's working directory, so the cluster runs
this checkout's raydp. Exits with 0 only if the job succeeded.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIP_EXCLUDES = [".venv", ".git", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"]
DEFAULT_ENTRYPOINT = ["python", "-m", "raydp", "demo", "--no-progress"]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", required=True, help="the cluster's dashboard address, e.g. http://head:8265")
    p.add_argument("--no-wait", action="store_true", help="print the job id and return at once")
    p.add_argument("entrypoint", nargs="*", help="command to run (default: raydp demo)")
    return p.parse_args(argv)


async def follow(client: object, job_id: str) -> None:
    async for lines in client.tail_job_logs(job_id):  # type: ignore[attr-defined]
        print(lines, end="", flush=True)


def main(argv: list[str]) -> int:
    from ray.job_submission import JobStatus, JobSubmissionClient

    args = parse_args(argv)
    client = JobSubmissionClient(args.address)
    entrypoint = " ".join(args.entrypoint or DEFAULT_ENTRYPOINT)
    job_id = client.submit_job(
        entrypoint=entrypoint,
        runtime_env={"working_dir": str(ROOT), "excludes": SHIP_EXCLUDES},
    )
    print(f"submitted {job_id}: {entrypoint}", flush=True)
    if args.no_wait:
        return 0
    asyncio.run(follow(client, job_id))
    status = client.get_job_status(job_id)
    print(f"job {job_id}: {status}")
    return 0 if status == JobStatus.SUCCEEDED else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
