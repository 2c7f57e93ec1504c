#!/usr/bin/env python3
"""Side-by-side benchmarks of raydp against its floor and against Ray's own paths.

Run as ``.venv/bin/python scripts/bench.py [--quick] [--only SECTION] [--skip SECTION]
[--json out.json]``. It starts its own local Ray (4 logical CPUs, 4 logical
GPUs) and needs no cluster.

Only the RATIOS mean anything: every system runs in the same process, on the
same machine, minutes apart, so a shared or slow machine moves all of them
together. Nine benchmarks (sections ``round-trips``, ``lockstep``, ``http``,
``workers``, ``scale``, ``startup``, ``coordinator``, ``routing``, ``faults``):

1. request round trips (tiny prompt, ``max_tokens=1``), pipelined (a window
   of requests in flight) and sequential (one at a time: p50 latency), for
   raydp (DP=2; same-node IPC, and TCP with and without CURVE), raw ZeroMQ +
   msgspec with 2 server processes (the floor),
   plain Ray actor calls, the same actors in STRICT_PACK placement groups,
   and Ray Serve with 2 replicas;
2. lockstep overhead: the step rate of a busy DP=2 cluster in lockstep mode
   (with and without a per-step all-reduce in the engine) against the same
   cluster in dense mode. ``EchoEngine(step_delay_s=...)`` sleeps in each step
   to stand in for device time; ``step_delay_s=0`` is the worst case;
3. the HTTP front-end (:mod:`bench_http`): OpenAI ``/v1/completions``
   throughput and p50/p99 latency, plain and streamed (time to first token),
   of raydp's 4 API servers against a Ray Serve HTTP deployment with the same
   echo engine and replica count;
4. device workers (:mod:`bench_workers`): the per-step round trip of one
   rank's workers (broadcast a small step input, gather the driver worker's
   output) at world sizes 1, 2 and 4, through raydp's channel
   (``RayExecutor``), a plain Ray actor call per worker, and a Ray Compiled
   Graph over the same actors, against a direct in-process call (the floor);
5. elastic scaling (:mod:`bench_scale`): the time to add one rank and to
   remove one (DP 2 -> 3 -> 2), dense and lockstep, against a fresh launch of
   DP=3 and a bare Ray actor started in a new placement group;
6. startup (:mod:`bench_scale`): the time until a new DP=4 cluster answers a
   request, dense and lockstep, against 4 bare torch-importing Ray actors
   started together in 4 STRICT_PACK groups;
7. the coordinator at scale (:mod:`bench_coordinator`, no Ray): the real
   coordinator loop against 64, 256 and 1,024 simulated engines sending
   stats through real sockets; its CPU share and the snapshot lag (p50/p99)
   from a stats change to a client seeing it. ``--only coordinator`` starts no Ray;
8. routing under skew (:mod:`bench_routing`): p50/p99 latency and each
   rank's share for raydp's balancer, round robin and power-of-two choices,
   with arrivals from 2 API server processes and a driver client, on a
   skewed (10% long requests) and a uniform workload;
9. failures (:mod:`bench_faults`, its own 2-node Ray in a process of its
   own): per fault (kill a rank, a worker, the coordinator, an API server;
   remove a node; kill a lockstep rank), the time until it is detected and
   until the cluster serves again, and the requests lost under a light load;
   ``faults-extra`` (:mod:`bench_faults_extra`, not in the default run: it
   needs root for network namespaces) adds a partitioned node, SIGTERM on
   ``raydp serve`` and ``ray job stop``.

``vllm`` (:mod:`bench_vllm`, not in the default run either: minutes of vLLM
starts) is the LLM-level anchor: raydp with vLLM engines at DP=2 against
vLLM's own ``--data-parallel-size 2`` server, same checkpoint and streamed
workload, plus a killed engine under load.

It prints the environment, the exact command and markdown tables, and exits
0 when every measurement ran (1 if one failed; the tables say which).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench_common import FULL, QUICK, Sizes, log
from bench_coordinator import (
    COORDINATOR_FULL,
    COORDINATOR_QUICK,
    CoordinatorResult,
    coordinator_benchmark,
    coordinator_failed,
    coordinator_table,
)
from bench_faults import FaultRow, faults_benchmark, faults_failed, faults_table
from bench_faults_extra import extra_benchmark, extra_table
from bench_http import HttpResult, http_benchmark, http_failed, http_table
from bench_http_load import HTTP_FULL, HTTP_QUICK, HttpSizes
from bench_lockstep import StepRate, lockstep_benchmark, lockstep_table
from bench_roundtrip import RoundTrip
from bench_routing import (
    ROUTING_FULL,
    ROUTING_QUICK,
    RoutingResult,
    routing_benchmark,
    routing_failed,
    routing_table,
)
from bench_scale import ScaleTiming, scale_benchmark, scale_failed, scale_table, startup_benchmark, startup_table
from bench_turns import round_trip_benchmark, round_trip_table
from bench_vllm import VllmReport, vllm_benchmark, vllm_failed, vllm_table
from bench_workers import (
    WORKERS_FULL,
    WORKERS_QUICK,
    StepLatency,
    WorkerSizes,
    workers_benchmark,
    workers_failed,
    workers_table,
)

SECTIONS = ("round-trips", "lockstep", "http", "workers", "scale", "startup", "coordinator", "routing", "faults",
            "faults-extra", "vllm")
# need no Ray of the bench's (faults start their own, elsewhere; vllm's servers too)
NO_RAY = ("coordinator", "faults", "faults-extra", "vllm")
OPT_IN = ("faults-extra", "vllm")  # run only when named with --only


def environment(sizes: Sizes, quick: bool) -> dict[str, Any]:
    from importlib.metadata import version

    import zmq

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parent,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {
        "command": shlex.join(sys.orig_argv),
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "ray": version("ray"),
        "torch": version("torch"),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "msgspec": version("msgspec"),
        "raydp_commit": commit,
        "quick": quick,
        "sizes": asdict(sizes),
    }


@dataclass
class Report:
    """What one run measured; a section left out (``--only``, ``--skip``) stays None."""

    trips: list[RoundTrip] | None = None
    steps: list[StepRate] | None = None
    floor: dict[float, tuple[float, float]] | str | None = None
    http: list[HttpResult] | None = None
    workers: list[StepLatency] | None = None
    scale: list[ScaleTiming] | None = None
    startup: list[ScaleTiming] | None = None
    routing: list[RoutingResult] | None = None
    coordinator: list[CoordinatorResult] | None = None
    faults: list[FaultRow] | None = None
    faults_extra: list[FaultRow] | None = None
    vllm: VllmReport | None = None

    def failed(self) -> bool:
        return (
            any(r.error for r in self.trips or [])
            or any(r.error for r in self.steps or [])
            or isinstance(self.floor, str)
            or (self.http is not None and http_failed(self.http))
            or (self.workers is not None and workers_failed(self.workers))
            or (self.scale is not None and scale_failed(self.scale))
            or (self.startup is not None and scale_failed(self.startup))
            or (self.routing is not None and routing_failed(self.routing))
            or (self.coordinator is not None and coordinator_failed(self.coordinator))
            or (self.faults is not None and faults_failed(self.faults))
            or (self.faults_extra is not None and faults_failed(self.faults_extra))
            or (self.vllm is not None and vllm_failed(self.vllm))
        )

    def as_json(self, env: dict[str, Any], http_sizes: HttpSizes, worker_sizes: WorkerSizes) -> dict[str, Any]:
        payload: dict[str, Any] = {"environment": env}
        if self.trips is not None:
            payload["round_trips"] = [asdict(r) for r in self.trips]
        if self.steps is not None:
            payload["step_rates"] = [asdict(r) for r in self.steps]
        if isinstance(self.floor, dict):
            payload["floor"] = {str(d): {"bare_loop": a, "gloo_allreduce": b} for d, (a, b) in self.floor.items()}
        elif self.floor is not None:
            payload["floor"] = {"error": self.floor}
        if self.http is not None:
            payload["http"] = {"sizes": asdict(http_sizes), "results": [asdict(r) for r in self.http]}
        if self.workers is not None:
            payload["workers"] = {"sizes": asdict(worker_sizes), "results": [asdict(r) for r in self.workers]}
        if self.scale is not None:
            payload["scale"] = [asdict(r) for r in self.scale]
        if self.startup is not None:
            payload["startup"] = [asdict(r) for r in self.startup]
        if self.routing is not None:
            payload["routing"] = [asdict(r) for r in self.routing]
        if self.coordinator is not None:
            payload["coordinator"] = [asdict(r) for r in self.coordinator]
        if self.faults is not None:
            payload["faults"] = [asdict(r) for r in self.faults]
        if self.faults_extra is not None:
            payload["faults_extra"] = [asdict(r) for r in self.faults_extra]
        if self.vllm is not None:
            payload["vllm"] = self.vllm.as_json()
        return payload


def run_sections(sections: list[str], sizes: Sizes, http_sizes: HttpSizes, worker_sizes: WorkerSizes) -> Report:
    report = Report()
    if "round-trips" in sections:
        report.trips = round_trip_benchmark(sizes, rounds=1 if sizes is QUICK else 3)
    if "lockstep" in sections:
        report.steps, report.floor = lockstep_benchmark(sizes)
    if "http" in sections:
        report.http = http_benchmark(http_sizes, log)
    if "workers" in sections:
        report.workers = workers_benchmark(worker_sizes)
    if "scale" in sections:
        report.scale = scale_benchmark(reps=2 if worker_sizes is WORKERS_QUICK else 5)
    if "routing" in sections:
        report.routing = routing_benchmark(ROUTING_QUICK if worker_sizes is WORKERS_QUICK else ROUTING_FULL)
    if "startup" in sections:
        report.startup = startup_benchmark(reps=1 if worker_sizes is WORKERS_QUICK else 3)
    if "coordinator" in sections:
        report.coordinator = coordinator_benchmark(COORDINATOR_QUICK if sizes is QUICK else COORDINATOR_FULL)
    if "faults" in sections:
        report.faults = faults_benchmark(trials=2 if sizes is QUICK else 5)
    if "faults-extra" in sections:
        report.faults_extra = extra_benchmark(trials=2 if sizes is QUICK else 5)
    if "vllm" in sections:
        report.vllm = vllm_benchmark(quick=sizes is QUICK)
    return report


def print_report(
    env: dict[str, Any], report: Report, sizes: Sizes, http_sizes: HttpSizes, worker_sizes: WorkerSizes
) -> None:
    print()
    print("## raydp benchmark")
    print()
    print(f"command: `{env['command']}`")
    print()
    print(
        f"environment: {env['cpus']} CPUs ({env['cpus_usable']} usable), Python {env['python']}, "
        f"ray {env['ray']}, torch {env['torch']}, pyzmq {env['pyzmq']} (libzmq {env['libzmq']}), "
        f"msgspec {env['msgspec']}, raydp {env['raydp_commit']}, {env['platform']}"
    )
    print("Local Ray: num_cpus=4, num_gpus=4 (logical). Absolute numbers are noise on a shared machine;")
    print("compare the ratios, which come from one run.")
    for lines in report_tables(report, sizes, http_sizes, worker_sizes).values():
        print()
        print("\n".join(lines))


def report_tables(
    report: Report, sizes: Sizes, http_sizes: HttpSizes, worker_sizes: WorkerSizes
) -> dict[str, list[str]]:
    """Each section's markdown lines (tables and verdicts), by section name, in run order."""
    out: dict[str, list[str]] = {}
    if report.trips is not None:
        out["round-trips"] = round_trip_table(report.trips, sizes)
    if report.steps is not None and report.floor is not None:
        out["lockstep"] = lockstep_table(report.steps, report.floor, sizes)
    if report.http is not None:
        out["http"] = http_table(report.http, http_sizes)
    if report.workers is not None:
        out["workers"] = workers_table(report.workers, worker_sizes)
    if report.scale is not None:
        out["scale"] = scale_table(report.scale)
    if report.startup is not None:
        out["startup"] = startup_table(report.startup)
    if report.routing is not None:
        sizes_r = ROUTING_QUICK if worker_sizes is WORKERS_QUICK else ROUTING_FULL
        out["routing"] = routing_table(report.routing, sizes_r)
    if report.coordinator is not None:
        out["coordinator"] = coordinator_table(report.coordinator)
    if report.faults is not None:
        out["faults"] = faults_table(report.faults)
    if report.faults_extra is not None:
        out["faults-extra"] = extra_table(report.faults_extra)
    if report.vllm is not None:
        out["vllm"] = vllm_table(report.vllm)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test in about a minute")
    parser.add_argument(
        "--only",
        action="append",
        choices=SECTIONS,
        metavar="SECTION",
        help=f"run only this section (repeatable): {', '.join(SECTIONS)}",
    )
    parser.add_argument(
        "--skip", action="append", choices=SECTIONS, metavar="SECTION", help="leave this section out (repeatable)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write every number to this JSON file")
    parser.add_argument("--plot", metavar="DIR", help="also draw every table as PNG charts in DIR (matplotlib)")
    args = parser.parse_args(argv)
    default = [s for s in SECTIONS if s not in OPT_IN]
    sections = [s for s in SECTIONS if s in (args.only or default) and s not in (args.skip or [])]
    if not sections:
        parser.error("--only and --skip leave no section to run")
    sizes = QUICK if args.quick else FULL
    http_sizes = HTTP_QUICK if args.quick else HTTP_FULL
    worker_sizes = WORKERS_QUICK if args.quick else WORKERS_FULL
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    import ray

    env = environment(sizes, args.quick)
    env["sections"] = sections
    env["http_sizes"] = asdict(http_sizes)
    env["worker_sizes"] = asdict(worker_sizes)
    start = time.perf_counter()
    # address="local": always a fresh Ray of our own, never one found via RAY_ADDRESS
    # or /tmp/ray/ray_current_cluster (another user's cluster on this machine).
    needs_ray = any(s not in NO_RAY for s in sections)
    if needs_ray:
        ray.init(address="local", num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False)
    try:
        report = run_sections(sections, sizes, http_sizes, worker_sizes)
    finally:
        if needs_ray:
            ray.shutdown()
    env["wall_s"] = round(time.perf_counter() - start, 1)
    print_report(env, report, sizes, http_sizes, worker_sizes)
    print()
    print(f"(ran in {env['wall_s']} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_json(env, http_sizes, worker_sizes), indent=2) + "\n")
    if args.plot:
        from bench_plot import plot_sections

        for path in plot_sections(report_tables(report, sizes, http_sizes, worker_sizes), Path(args.plot)):
            print(f"wrote {path}")
    return 1 if report.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
