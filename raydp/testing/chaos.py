"""Seeded chaos soak: steady load while random faults hit a raydp cluster; then every request is accounted for.

Run as ``.venv/bin/python -m raydp.testing.chaos --seed S --minutes M [--json]`` (under
``flock /tmp/raydp-ray.lock`` on a shared machine). It starts its own local Ray
(a head and one worker node, 2 logical GPUs each), launches DP=4 ranks of
``WorkerEchoEngine`` (one device worker per rank; its ``HangableWorkerEchoEngine``
form, which can hang on demand) with restarts allowed, and two
API server processes. Load: a driver client (``retryable`` requests) and HTTP
clients, each bounded in concurrency and rate. Faults (``faults.KINDS``): every
kind once, in a seeded order, then seeded random kinds, at seeded random gaps;
after each, the soak times the death report and waits until what it hit serves
again.

Both loads' streams migrate (the driver's requests are ``migratable``, the API
servers run with ``migration_limit=3``): a stream cut by a rank's death goes on
from its last token on a live rank, and is checked for it (every token there,
in order, nothing repeated: ``fault_load.echo_moves``); the summary counts the
migrated streams and their moves per source.

Checks, each a violation (exit code 1, named on stderr) when broken: no request
lost (hung or never answered), wrong or answered twice, none failed untyped;
every fault detected and recovered from; the driver's RSS and open fds, and
the largest of the cluster's actor processes', bounded (the last sample at
most 1.5x the first after warm-up, plus a slack); after
``close()`` no raydp actor, placement group, socket directory or API server
process left. ``--json`` prints the summary as JSON on stdout (the table goes
to stderr).

``--hosts netns`` (root and ``ip netns`` needed) runs the same soak on real
hosts instead: network namespaces with their own IPs on 10.213.7.0/24
(``netns_ray.NetnsRay``: the head, driver and API servers in the root
namespace, 3 namespace hosts of 1 logical GPU, Ray's health check at 500 ms /
1 s / 3 failures), DP=2 with one host spare. Its kinds
(``faults.NETNS_KINDS``) add ``partition``: the veth of a host holding a rank
(never rank 0's, whose node the coordinator is pinned to) goes down, the rank
must be reported dead ("node died") and serve again from the spare host, and
a fresh namespace host is started so the next partition finds capacity.
``node-remove`` is left out there (the partition is that mode's node loss).
Locally rank 0, and the coordinator with it, start on the worker node, so the
first ``node-remove`` takes the coordinator's node: its successor starts on a
live node and every client (the driver's, the API servers') follows it there.
After ``close()`` no process it started, namespace or link may be left either.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import raydp
from raydp.serve.settings import ServerSettings
from raydp.testing import netns_ray
from raydp.testing.chaos_report import FaultRecord, Summary, fmt, table
from raydp.testing.chaos_vllm import VLLM_ENGINE, VLLM_KINDS, VLLM_STEP_TIMEOUT_S, EngineSetup, unbroken_answers
from raydp.testing.fault_load import Answers, DriverLoad, HttpLoad, Ledger, LoadShape, ResourceSampler
from raydp.testing.faults import KINDS, NETNS_KINDS, Fault, Injector, LocalRay, actor_processes, wait_for
from raydp.testing.leftovers import live_actors, live_groups, socket_dirs, wait_until

ENGINE = "raydp.testing.hangs:HangableWorkerEchoEngine"  # WorkerEchoEngine, plus a hang on demand
# A hung rank is ended after this: short, to soak many faults, yet far above a turn of these engines
# (10 ms steps) even on 2 busy cores.
STEP_TIMEOUT_S = 4.0
WARMUP_S = 8.0  # load before the resource baseline is taken
# Ray's node death (a partition: the health check's 3 failed 500 ms probes, and then some on a busy box);
# a process death is seen within 0.1 s
DETECT_TIMEOUT_S = {"node-remove": 60.0, "partition": 60.0}  # and a hang: the mode's step timeout + 10 s
RECOVER_TIMEOUT_S = 180.0  # a vLLM rank reloads its model
GAP_S = (1.0, 4.0)  # between one fault's recovery and the next fault
RSS_SLACK, FD_SLACK = 64 << 20, 48
GROWTH = 1.5
HTTP_LOAD = LoadShape(rate=6, concurrency=3)


@dataclass(frozen=True)
class Pace:
    """How long the load runs before the first fault, and the seeded gaps between faults."""

    warmup_s: float = WARMUP_S
    gap_s: tuple[float, float] = GAP_S


@dataclass(frozen=True)
class Mode:
    """Where the soak runs: the Ray, the cluster's size, the fault kinds, the engine, the loads."""

    kinds: tuple[str, ...]
    dp_size: int
    dp_size_local: int
    driver_load: LoadShape
    http_load: LoadShape = HTTP_LOAD
    engine: str = ENGINE
    step_timeout_s: float = STEP_TIMEOUT_S

    @property
    def vllm(self) -> bool:
        return self.engine == VLLM_ENGINE


MODES = {
    "local": Mode(KINDS, 4, 2, LoadShape(rate=20, concurrency=8)),
    # Three namespace hosts (two ranks and a spare) is what 2 cores carry beside the load.
    "netns": Mode(NETNS_KINDS, 2, 1, LoadShape(rate=12, concurrency=6)),
    # Real vLLM engines on the small model, on the local Ray: what 2 cores carry is two ranks and a light load.
    # A vLLM rank has no device workers (so no worker kill), and its restart reloads the model.
    "vllm": Mode(
        VLLM_KINDS,
        2,
        1,
        # Streams long enough (up to ANSWER_TOKENS) that a fault finds some mid-answer, to move them.
        LoadShape(rate=3, concurrency=3, max_tokens=(16, 64), hung_after_s=120),
        LoadShape(rate=2, concurrency=2, max_tokens=(16, 64), hung_after_s=120),
        engine=VLLM_ENGINE,
        step_timeout_s=VLLM_STEP_TIMEOUT_S,
    ),
}
NETNS_HOSTS = 3


def schedule(rng: random.Random, kinds: tuple[str, ...]) -> Any:
    """Every kind once (a seeded order), then seeded random kinds, forever."""
    first = list(kinds)
    rng.shuffle(first)
    yield from first
    while True:
        yield rng.choice(kinds)


def soak(seed: int, minutes: float, hosts: str = "local", pace: Pace = Pace(), model: str | None = None) -> Summary:
    """``hosts``: a key of :data:`MODES`; ``model``: the vLLM mode's checkpoint (built if missing)."""
    rng = random.Random(seed)
    summary = Summary(seed, minutes, hosts, MODES[hosts].kinds)
    started = time.monotonic()
    mode = MODES[hosts]
    engine = EngineSetup.of(mode.vllm, model)
    local: Any = netns_ray.NetnsRay(NETNS_HOSTS) if hosts == "netns" else LocalRay((2, 2))
    exit_on_sigterm()  # again: ray.init put its own (aborting) SIGTERM handler in place
    name = f"chaos{seed}"
    try:
        # Rank 0 and the coordinator beside it go to a node a fault may take away: locally the worker
        # node (node-remove), which moves the coordinator to the head; the netns head holds no GPU.
        first = local.first_host() if hosts == "netns" else local.worker_nodes()[0].node_id
        cluster = raydp.launch(
            name=name,
            engine=mode.engine,
            dp_size=mode.dp_size,
            dp_size_local=mode.dp_size_local,
            progress=False,
            engine_kwargs=engine.kwargs,
            max_restarts=10_000,
            restart_backoff_s=0,  # the soak times recovery itself, not the policy's backoff
            step_timeout_s=mode.step_timeout_s,
            coordinator_max_restarts=10_000,
            master_node_id=first,
            **engine.launch,
        )
        try:
            settings = ServerSettings(max_restarts=10_000, request_timeout_s=60, migration_limit=3, **engine.servers)
            servers = cluster.serve_api(2, settings=settings)
            answers = unbroken_answers(cluster, random.Random(seed)) if mode.vllm else Answers()
            run_faults(cluster, local, servers, rng, seed, minutes, summary, mode, pace, answers)
        finally:
            cluster.close()
        summary.leftovers = leftovers(name, servers.procs)
    finally:
        local.shutdown()
    if hosts == "netns":
        summary.leftovers += local.leftovers()
    summary.wall_s = round(time.monotonic() - started, 1)
    return summary


def exit_on_sigterm() -> None:
    """A SIGTERM (a test's timeout, say) unwinds through the finally blocks: Ray nodes and namespaces go too."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def run_faults(
    cluster: raydp.Cluster,
    local: Any,
    servers: Any,
    rng: random.Random,
    seed: int,
    minutes: float,
    summary: Summary,
    mode: Mode,
    pace: Pace,
    answers: Answers,
) -> None:
    injector = Injector(cluster, local, servers, echo=not mode.vllm)
    ledger = Ledger(answers)
    driver = cluster.client()
    loads = [
        DriverLoad(driver, ledger, mode.driver_load, seed),
        HttpLoad(servers.url, ledger, mode.http_load, seed + 1, injector.server_killed_between),
    ]
    sampler = ResourceSampler()
    for load in loads:
        load.start()
    sampler.start()
    time.sleep(pace.warmup_s)
    baseline = sampler.take()
    actors0 = actor_processes(cluster.name)
    deadline = time.monotonic() + minutes * 60
    kinds = schedule(rng, mode.kinds)
    while time.monotonic() < deadline or len(summary.by_kind()) < len(mode.kinds):
        time.sleep(rng.uniform(*pace.gap_s))
        kind = next(kinds)
        if kind == "node-remove" and not injector.node_with_ranks():
            kind = "rank-sigkill"
        rank = rng.randrange(cluster.dp_size)
        fault = injector.inject(kind, rank=rank, api_index=rng.randrange(len(servers.procs)))
        summary.faults.append(record := measure(injector, fault, mode))
        injector.settle(fault)
        log(f"{record.kind:20} {record.target:40} detected {fmt(record.detect_s)}  back {fmt(record.back_s)}")
        if record.detect_s is None or record.back_s is None:
            summary.violations.append(
                f"{fault.kind} on {fault.target}: {'not detected' if record.detect_s is None else 'not recovered'}"
            )
            break
    stuck = sum(load.stop() for load in loads)
    sampler.stop()
    final = sampler.take()
    actors1 = actor_processes(cluster.name)
    summary.requests = ledger.summary()
    summary.requests["driver_stream_moves"] = driver.migrations  # streams the driver's client moved (any engine)
    summary.requests["stuck_threads"] = stuck
    summary.resources = {
        "driver_rss_mb": [round(baseline.rss / 2**20, 1), round(final.rss / 2**20, 1)],
        "driver_fds": [baseline.fds, final.fds],
        "driver_rss_max_mb": round(max(s.rss for s in sampler.samples) / 2**20, 1),
        "driver_fds_max": max(s.fds for s in sampler.samples),
        "actor_rss_max_mb": [round(actors0[0] / 2**20, 1), round(actors1[0] / 2**20, 1)],
        "actor_fds_max": [actors0[1], actors1[1]],
    }
    check(summary, ledger, baseline.rss, final.rss, baseline.fds, final.fds)
    if actors1[0] > GROWTH * actors0[0] + RSS_SLACK or actors1[1] > GROWTH * actors0[1] + FD_SLACK:
        summary.violations.append(
            f"an actor process grew: largest RSS {actors0[0] >> 20} -> {actors1[0] >> 20} MiB, "
            f"most fds {actors0[1]} -> {actors1[1]}"
        )


def measure(injector: Injector, fault: Fault, mode: Mode) -> FaultRecord:
    bound = mode.step_timeout_s + 10.0 if fault.kind == "rank-hang" else DETECT_TIMEOUT_S.get(fault.kind, 10.0)
    detect = wait_for(lambda: injector.detected(fault), fault.at, bound, 0.005)
    back = wait_for(lambda: injector.serving(fault), fault.at, RECOVER_TIMEOUT_S, 0.02)
    if back is not None and wait_for(injector.all_serving, fault.at, RECOVER_TIMEOUT_S, 0.1) is None:
        back = None  # what it hit is back, but something else is not
    return FaultRecord(fault.kind, fault.target, detect, back)


def check(summary: Summary, ledger: Ledger, rss0: int, rss1: int, fds0: int, fds1: int) -> None:
    v = summary.violations
    for outcome in ("wrong", "duplicate", "untyped"):
        if ledger.total(outcome):
            v.append(f"{ledger.total(outcome)} requests {outcome}")
    if ledger.lost():
        v.append(f"{ledger.lost()} requests lost (hung or never answered)")
    if summary.requests["stuck_threads"]:
        v.append(f"{summary.requests['stuck_threads']} load threads never returned")
    if not sum(ledger.submitted.values()):
        v.append("no request was sent")
    if rss1 > GROWTH * rss0 + RSS_SLACK:
        v.append(f"driver RSS grew from {rss0 >> 20} MiB to {rss1 >> 20} MiB")
    if fds1 > GROWTH * fds0 + FD_SLACK:
        v.append(f"driver open fds grew from {fds0} to {fds1}")
    v.extend(f"example: {e}" for e in ledger.examples)


def leftovers(name: str, procs: list[Any]) -> list[str]:
    """What a closed cluster left behind: actors, groups, socket directories, API server processes."""

    def in_ray() -> list[str]:
        return [f"actor {a}" for a in live_actors(name)] + [f"placement group {g}" for g in live_groups(name)]

    wait_until(lambda: not in_ray() and not socket_dirs(name), timeout=30)
    left = in_ray()
    left += [f"socket directory {d}" for d in socket_dirs(name)]
    left += [f"API server pid {p.process.pid}" for p in procs if p.process.is_alive()]
    return left


def log(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--minutes", type=float, required=True, help="soak length (setup and checks come on top)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON on stdout")
    parser.add_argument(
        "--hosts",
        choices=sorted(MODES),
        default="local",
        help="local: a local 2-node Ray; netns: namespace hosts with their own IPs, and partitions "
        "(needs root and ip netns); vllm: the local Ray with real vLLM engines on the small model",
    )
    parser.add_argument("--model", help="--hosts vllm: the checkpoint (default: raydp make-model's, built if missing)")
    parser.add_argument("--warmup-s", type=float, default=WARMUP_S, help="load before the first fault")
    parser.add_argument(
        "--gap-s", type=float, nargs=2, default=GAP_S, metavar=("LOW", "HIGH"), help="seeded pause between faults"
    )
    args = parser.parse_args(argv)
    if args.warmup_s < 0 or not 0 <= args.gap_s[0] <= args.gap_s[1]:
        parser.error(f"--warmup-s {args.warmup_s} --gap-s {args.gap_s}: need 0 <= warmup and 0 <= LOW <= HIGH")
    exit_on_sigterm()
    pace = Pace(args.warmup_s, (args.gap_s[0], args.gap_s[1]))
    summary = soak(args.seed, args.minutes, args.hosts, pace, args.model)
    if summary.leftovers:
        summary.violations.append(f"left after close: {summary.leftovers}")
    print("\n".join(table(summary)), file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps({**asdict(summary), "faults_by_kind": summary.by_kind()}))
    for violation in summary.violations:
        print(f"chaos: VIOLATION: {violation}", file=sys.stderr)
    return 1 if summary.violations else 0


if __name__ == "__main__":
    sys.exit(main())
