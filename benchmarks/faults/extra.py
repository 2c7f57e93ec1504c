"""The failure table's other rows: a partitioned node, SIGTERM on ``raydp serve``, ``ray job stop``.

Run alone as ``.venv/bin/python -m benchmarks.faults.extra [--trials N] [--only ROW] [--json PATH]``
or as the ``faults-extra`` section of ``python -m benchmarks`` (a process of its
own: each row starts its own Ray). Rows, ``trials`` each (default 5):

* **partition node**: a fresh Ray per trial over network-namespace hosts
  (:mod:`raydp.testing.netns`: a bridge on 10.213.7.0/24, one Ray node per
  namespace with 1 logical GPU, the head in the root namespace with none, Ray's
  health check at 500 ms / 1 s timeout / 3 failures). DP=2 over 3 hosts,
  ``max_restarts=1``: the third host is spare capacity. The host of rank 1
  has its veth brought down. *Detected*: link down to rank 1's
  ``EngineDeadError`` in ``cluster.deaths``. *Back*: link down to a request
  pinned to rank 1 answered, by the rank re-placed on the spare host. Load: a
  driver client's ``retryable`` requests (~6/s, to both ranks). Needs root
  and ``ip netns``; skipped with the reason otherwise.
* **SIGTERM raydp serve** (``--backend mp`` and the Ray backend): two API
  servers, echo engine at 20 ms a step, ``--graceful-shutdown-s 2``; per
  trial 5 HTTP requests in flight (2 plain and 2 streams that cannot end in
  the grace period, 1 short stream that can). *Detected*: SIGTERM to a new
  request refused (503 or connection refused). *Stopped*: SIGTERM to the
  process's exit. Every in-flight request must end whole (a 503 in OpenAI's
  shape or a stream ending in an error event is typed; the short one must
  finish); a reset or cut body is lost. Nothing may be left: no child process,
  no IPC dir for that cluster name.
* **ray job stop**: ``python -m raydp serve`` submitted as a Ray Job to a local
  2-node Ray (``RAY_JOB_STOP_WAIT_TIME_S=10``); 2 requests in flight; *stopped*
  is ``stop_job`` to status STOPPED; then no live actor, placement group or IPC
  dir of that cluster name.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.faults.table import FaultRow, faults_failed, faults_table, rows_from_process

TRIALS = 5
ROWS = ("partition", "sigterm-mp", "sigterm-ray", "sigterm-demo", "job-stop")


def extra_table(rows: list[FaultRow]) -> list[str]:
    """:func:`~benchmarks.faults.table.faults_table`, with what these rows measure in place of its load line."""
    lines = faults_table(rows)
    lines[0] = "### Failures: partition, SIGTERM, ray job stop"
    lines[2] = (
        "Medians of the trials (min-max in brackets). Partition: driver ~6 req/s (retryable); detected = link "
        "down to the rank's death report, serving again = to the rank re-placed and answering. SIGTERM and "
        "ray job stop: 5 HTTP requests in flight per trial; detected = the signal to a new request refused "
        "or reset, the next column = to the process's exit (STOPPED for a job)."
    )
    lines[-1] = "Lost must be 0; typed are the in-flight requests answered with a 503 or a stream error event."
    return lines


# ---- entry points ------------------------------------------------------------------------------------------------


def run_rows(trials: int, only: list[str]) -> list[FaultRow]:
    """The rows named in ``only``; each row's module is imported only when that row runs."""
    rows = []
    for name in only:
        try:
            if name == "partition":
                from benchmarks.faults.partition import partition_row

                rows.append(partition_row(trials))
            elif name == "sigterm-mp":
                from benchmarks.faults.stop import sigterm_row

                rows.append(sigterm_row(trials, "mp"))
            elif name == "sigterm-ray":
                from benchmarks.faults.stop import sigterm_row

                rows.append(sigterm_row(trials, "ray"))
            elif name == "sigterm-demo":
                from benchmarks.faults.stop import demo_row

                rows.append(demo_row(trials))
            elif name == "job-stop":
                from benchmarks.faults.stop import job_stop_row

                rows.append(job_stop_row(trials))
        except Exception as exc:  # a failed row is reported, not fatal
            rows.append(FaultRow(name, "", [], [], error=repr(exc)[:300]))
    return rows


def extra_benchmark(trials: int = TRIALS, run: Callable[..., Any] = subprocess.run) -> list[FaultRow]:
    """The rows, measured in a process of its own (each row starts its own Ray)."""
    return rows_from_process("benchmarks.faults.extra", trials, run, timeout=3600)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--trials", type=int, default=TRIALS)
    parser.add_argument("--only", action="append", choices=ROWS, help="measure only this row (repeatable)")
    parser.add_argument("--json", metavar="PATH", help="also write the rows to this JSON file")
    parser.add_argument("--quiet", action="store_true", help="print no table (python -m benchmarks prints it)")
    parser.add_argument("--partition-driver", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--address", help=argparse.SUPPRESS)
    parser.add_argument("--hosts", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.partition_driver:
        from benchmarks.faults.partition import partition_driver

        hosts = [(h.split("=")[0], h.split("=")[1]) for h in args.hosts.split(",")]
        partition_driver(args.address, hosts, Path(args.json))
        return 0
    rows = run_rows(args.trials, args.only or list(ROWS))
    if not args.quiet:
        print("\n".join(extra_table(rows)))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    return 1 if faults_failed(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
