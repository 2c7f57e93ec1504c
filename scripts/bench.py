#!/usr/bin/env python3
"""Side-by-side benchmarks of raydp against its floor and against Ray's own paths.

Run as ``.venv/bin/python scripts/bench.py [--quick] [--only SECTION] [--skip SECTION]
[--json out.json]``. It starts its own local Ray (4 logical CPUs, 4 logical
GPUs) and needs no cluster.

Only the RATIOS mean anything: every system runs in the same process, on the
same machine, minutes apart, so a shared or slow machine moves all of them
together. Three benchmarks (sections ``round-trips``, ``lockstep``, ``http``):

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
   echo engine and replica count.

It prints the environment, the exact command and markdown tables, and exits
0 when every measurement ran (1 if one failed; the tables say which).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from bench_http import (
    HTTP_FULL,
    HTTP_QUICK,
    HttpResult,
    HttpSizes,
    http_benchmark,
    http_failed,
    http_table,
    quiet_serve_logs,
)

ECHO_ENGINE = "raydp.engine:EchoEngine"
PROMPT = [1, 2, 3]
DP_SIZE = 2
TIMEOUT_S = 60.0
STOP_TAG = b"\xff"
SECTIONS = ("round-trips", "lockstep", "http")
# Busy requests never finish inside a window: they are aborted after it.
BUSY_MAX_TOKENS = 1_000_000


@dataclass(frozen=True)
class Sizes:
    """Every size the run uses; ``--quick`` picks the small set."""

    pipelined: int  # requests in the pipelined run
    window: int  # requests in flight in the pipelined run
    sequential: int  # requests in the sequential run
    warmup: int  # untimed sequential requests before each system
    busy_per_rank: int  # pinned long requests per rank in the step-rate runs with a step delay
    busy_per_rank_no_delay: int  # the same at step_delay_s=0 (see FULL)
    step_window_s: float  # one step-rate measurement window
    step_windows: int  # windows per cluster (the median is reported)
    step_warmup_s: float  # busy time before the first window
    step_delays_s: tuple[float, ...]  # EchoEngine step_delay_s values


# At step_delay_s=0, 64 requests per rank make ~5x10^5 outputs/s: the one client
# cannot keep up, its backlog grows by GBs and the aborts wait behind it for
# tens of seconds. A few requests keep both ranks busy with near-empty steps,
# which is also the worst case for lockstep (its fixed costs weigh the most).
FULL = Sizes(
    pipelined=3000, window=256, sequential=400, warmup=50,
    busy_per_rank=64, busy_per_rank_no_delay=4,
    step_window_s=1.5, step_windows=3, step_warmup_s=0.5, step_delays_s=(0.002, 0.0),
)
QUICK = Sizes(
    pipelined=300, window=256, sequential=40, warmup=10,
    busy_per_rank=64, busy_per_rank_no_delay=4,
    step_window_s=0.5, step_windows=1, step_warmup_s=0.2, step_delays_s=(0.002, 0.0),
)


# ---- results ------------------------------------------------------------------------


@dataclass
class RoundTrip:
    """One system's request round trips."""

    system: str
    pipelined_rps: float = 0.0
    sequential_rps: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    error: str | None = None


@dataclass
class StepRate:
    """Steps per second per rank of one busy cluster, median over windows."""

    mode: str
    step_delay_s: float
    steps_per_s: float = 0.0  # mean over ranks of (steps + dummy_steps) / s
    per_rank: list[float] = field(default_factory=list)
    windows: list[float] = field(default_factory=list)
    dummy_fraction: float = 0.0
    collectives_per_s: float = 0.0
    error: str | None = None


# ---- the shared request loops --------------------------------------------------------


class EchoTarget(Protocol):
    """A system under test: ``send`` one tiny request, ``wait`` for its answer."""

    def send(self, i: int) -> Any: ...

    def wait(self, token: Any) -> None: ...


def run_pipelined(target: EchoTarget, n: int, window: int) -> float:
    """Keep ``window`` requests in flight; return requests per second."""
    inflight: deque[Any] = deque()
    start = time.perf_counter()
    for i in range(n):
        if len(inflight) >= window:
            target.wait(inflight.popleft())
        inflight.append(target.send(i))
    while inflight:
        target.wait(inflight.popleft())
    return n / (time.perf_counter() - start)


def run_sequential(target: EchoTarget, n: int, first: int = 0) -> list[float]:
    """One request at a time; return each round trip in seconds."""
    latencies = []
    for i in range(first, first + n):
        start = time.perf_counter()
        target.wait(target.send(i))
        latencies.append(time.perf_counter() - start)
    return latencies


def measure_round_trips(system: str, target: EchoTarget, sizes: Sizes) -> RoundTrip:
    run_sequential(target, sizes.warmup, first=-sizes.warmup)
    pipelined = run_pipelined(target, sizes.pipelined, sizes.window)
    latencies = run_sequential(target, sizes.sequential, first=sizes.pipelined)
    quantiles = statistics.quantiles(latencies, n=100)
    return RoundTrip(
        system,
        pipelined_rps=pipelined,
        sequential_rps=len(latencies) / sum(latencies),
        p50_ms=statistics.median(latencies) * 1e3,
        p99_ms=quantiles[98] * 1e3,
    )


def encoded_request(i: int) -> bytes:
    from raydp.wire.protocol import Request, encode

    return encode(Request(f"r{i}", PROMPT, 1))


def echo_reply(rank: int, body: bytes) -> bytes:
    """What every baseline server does: what EchoEngine answers for ``max_tokens=1``."""
    from raydp.wire.protocol import Output, OutputBatch, encode, request_decoder

    request = request_decoder(body)
    output = Output(request.request_id, request.prompt_token_ids[:1], True, "length")
    return encode(OutputBatch(rank, [output]))


# ---- raydp ---------------------------------------------------------------------------


class RaydpTarget:
    def __init__(self, client: Any) -> None:
        self.client = client

    def send(self, i: int) -> Any:
        return self.client.submit(PROMPT, 1)

    def wait(self, token: Any) -> None:
        token.result(TIMEOUT_S)


@contextlib.contextmanager
def raydp_target(**fields: str) -> Iterator[EchoTarget]:
    import raydp

    cluster = raydp.launch(name="bench", dp_size=DP_SIZE, engine=ECHO_ENGINE, progress=False, **fields)
    try:
        yield RaydpTarget(cluster.client())
    finally:
        cluster.close()


# ---- raw ZeroMQ + msgspec (the floor) ----------------------------------------------------


def zmq_echo_server(rank: int, address: str) -> None:
    """A ROUTER that answers each request at once (runs in a spawned process)."""
    import zmq

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    try:
        while True:
            client, tag, body = sock.recv_multipart()
            if tag == STOP_TAG:
                break
            sock.send_multipart([client, echo_reply(rank, body)])
    finally:
        sock.close()
        ctx.term()


class ZmqTarget:
    """One DEALER per server, round robin, like raydp's client (but no IO thread)."""

    def __init__(self, addresses: list[str]) -> None:
        import zmq

        self._zmq = zmq
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.socks = []
        self.poller = zmq.Poller()
        for address in addresses:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            self.poller.register(sock, zmq.POLLIN)
            self.socks.append(sock)
        self.done: set[str] = set()

    def send(self, i: int) -> Any:
        from raydp.wire.protocol import RequestType

        self.socks[i % len(self.socks)].send_multipart([RequestType.ADD.value, encoded_request(i)])
        return f"r{i}"

    def wait(self, token: Any) -> None:
        from raydp.wire.protocol import output_decoder

        deadline = time.monotonic() + TIMEOUT_S
        while token not in self.done:
            if time.monotonic() > deadline:
                raise TimeoutError(f"raw ZMQ request {token} got no answer in {TIMEOUT_S}s")
            for sock, _ in self.poller.poll(100):
                while True:
                    try:
                        body = sock.recv(self._zmq.NOBLOCK)
                    except self._zmq.Again:
                        break
                    self.done.update(out.request_id for out in output_decoder(body).outputs)
        self.done.discard(token)

    def stop_servers(self) -> None:
        for sock in self.socks:
            sock.send_multipart([STOP_TAG, b""])

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@contextlib.contextmanager
def zmq_target() -> Iterator[EchoTarget]:
    spawn = multiprocessing.get_context("spawn")
    ipc_dir = tempfile.mkdtemp(prefix="raydp-bench-")
    addresses = [f"ipc://{ipc_dir}/echo-{rank}" for rank in range(DP_SIZE)]
    servers = [spawn.Process(target=zmq_echo_server, args=(rank, a), daemon=True) for rank, a in enumerate(addresses)]
    for proc in servers:
        proc.start()
    target = ZmqTarget(addresses)
    try:
        yield target
    finally:
        target.stop_servers()
        for proc in servers:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        target.close()
        shutil.rmtree(ipc_dir, ignore_errors=True)


# ---- Ray actors, with and without placement groups ---------------------------------------


class EchoActor:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def echo(self, body: bytes) -> bytes:
        return echo_reply(self.rank, body)


class RayActorTarget:
    def __init__(self, actors: list[Any]) -> None:
        self.actors = actors

    def send(self, i: int) -> Any:
        return self.actors[i % len(self.actors)].echo.remote(encoded_request(i))

    def wait(self, token: Any) -> None:
        import ray

        from raydp.wire.protocol import output_decoder

        output_decoder(ray.get(token, timeout=TIMEOUT_S))


@contextlib.contextmanager
def ray_actor_target(placement_groups: bool) -> Iterator[EchoTarget]:
    """2 actors, round robin; each in a STRICT_PACK ``[{GPU: 1}, {CPU: 1}]`` group if asked."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    cls = ray.remote(EchoActor)
    groups: list[Any] = []
    actors: list[Any] = []
    try:
        if placement_groups:
            groups = [placement_group([{"GPU": 1}, {"CPU": 1}], strategy="STRICT_PACK") for _ in range(DP_SIZE)]
            ray.get([g.ready() for g in groups], timeout=TIMEOUT_S)
            actors = [
                cls.options(
                    num_cpus=1,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(g, placement_group_bundle_index=1),
                ).remote(rank)
                for rank, g in enumerate(groups)
            ]
        else:
            actors = [cls.options(num_cpus=1).remote(rank) for rank in range(DP_SIZE)]
        yield RayActorTarget(actors)
    finally:
        for actor in actors:
            ray.kill(actor)
        for group in groups:
            remove_placement_group(group)


# ---- Ray Serve -----------------------------------------------------------------------------


class ServeEcho:
    def __call__(self, body: bytes) -> bytes:
        return echo_reply(0, body)


class ServeTarget:
    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def send(self, i: int) -> Any:
        return self.handle.remote(encoded_request(i))

    def wait(self, token: Any) -> None:
        from raydp.wire.protocol import output_decoder

        output_decoder(token.result(timeout_s=TIMEOUT_S))


@contextlib.contextmanager
def serve_target(window: int) -> Iterator[EchoTarget]:
    """2 replicas behind a DeploymentHandle; no HTTP proxy (it would take a host port)."""
    from ray import serve

    serve.start(proxy_location="Disabled")
    quiet_serve_logs()
    try:
        deployment = serve.deployment(
            ServeEcho,
            name="bench-echo",
            num_replicas=DP_SIZE,
            ray_actor_options={"num_cpus": 0.5},
            # Let the pipelined run keep its window in flight, as the others do.
            max_ongoing_requests=max(window // DP_SIZE, 1),
            # Nothing is in flight at shutdown: do not wait for it.
            graceful_shutdown_wait_loop_s=0.1,
            graceful_shutdown_timeout_s=1.0,
        )
        handle = serve.run(deployment.bind(), name="bench", route_prefix=None)
        quiet_serve_logs()
        yield ServeTarget(handle)
    finally:
        serve.shutdown()


# ---- benchmark 1 ---------------------------------------------------------------------------


def round_trip_benchmark(sizes: Sizes) -> list[RoundTrip]:
    systems: list[tuple[str, Callable[[], contextlib.AbstractContextManager[EchoTarget]]]] = [
        ("raydp (DP=2)", raydp_target),
        ("raydp over TCP + CURVE (the cross-node path)", lambda: raydp_target(transport="tcp")),
        ("raydp over TCP, auth='none'", lambda: raydp_target(transport="tcp", auth="none")),
        ("raw ZMQ + msgspec (2 server procs)", zmq_target),
        ("Ray actor calls (2 actors)", lambda: ray_actor_target(placement_groups=False)),
        ("Ray actors in STRICT_PACK PGs", lambda: ray_actor_target(placement_groups=True)),
        ("Ray Serve (2 replicas, handle)", lambda: serve_target(sizes.window)),
    ]
    results = []
    for system, make in systems:
        log(f"round trips: {system}")
        try:
            with make() as target:
                results.append(measure_round_trips(system, target, sizes))
        except Exception as exc:
            results.append(RoundTrip(system, error=f"{type(exc).__name__}: {exc}"))
    return results


# ---- benchmark 2 ---------------------------------------------------------------------------

MODES = {
    # mode: (lockstep, EchoEngine collective). Dense has no DP group, so its
    # collective=True engine all-reduces nothing: the same engine, lockstep off.
    "dense": (False, True),
    "lockstep": (True, False),
    "lockstep+collective": (True, True),
}
BUSY_STEPS = 64  # steps every rank takes before the warm-up starts (gloo init, first wave)


def step_rate(mode: str, step_delay_s: float, sizes: Sizes, name: str) -> StepRate:
    """Launch a DP=2 cluster in ``mode``, keep both ranks busy, count steps per second."""
    import raydp

    lockstep, collective = MODES[mode]
    cluster = raydp.launch(
        name=name,
        dp_size=DP_SIZE,
        engine=ECHO_ENGINE,
        lockstep=lockstep,
        engine_kwargs={"collective": collective, "step_delay_s": step_delay_s},
        progress=False,
    )
    try:
        load = cluster.client()
        # Stats go through a second client: its replies do not queue behind the
        # flood of outputs the first one may be slow to read.
        probe = cluster.client()
        busy = sizes.busy_per_rank if step_delay_s else sizes.busy_per_rank_no_delay
        handles = [load.submit(PROMPT, BUSY_MAX_TOKENS, rank=rank) for rank in range(DP_SIZE) for _ in range(busy)]
        try:
            wait_stepping(probe, BUSY_STEPS)
            time.sleep(sizes.step_warmup_s)
            return measure_windows(probe, mode, step_delay_s, sizes)
        finally:
            for handle in handles:
                load.abort(handle.request_id)
            wait_done(handles)
            if lockstep:
                wait_paused(cluster)
    finally:
        cluster.close()


def measure_windows(probe: Any, mode: str, step_delay_s: float, sizes: Sizes) -> StepRate:
    windows: list[list[float]] = []
    total = dummies = collectives = 0
    elapsed = 0.0
    for _ in range(sizes.step_windows):
        before, t0 = rank_stats(probe), time.perf_counter()
        time.sleep(sizes.step_window_s)
        after, t1 = rank_stats(probe), time.perf_counter()
        rates = []
        for b, a in zip(before, after, strict=True):
            steps = a["steps"] + a["dummy_steps"] - b["steps"] - b["dummy_steps"]
            rates.append(steps / (t1 - t0))
            total += steps
            dummies += a["dummy_steps"] - b["dummy_steps"]
            collectives += a["collectives"] - b["collectives"]
        elapsed += t1 - t0
        windows.append(rates)
    means = [statistics.fmean(rates) for rates in windows]
    median = means.index(statistics.median_low(means))
    return StepRate(
        mode,
        step_delay_s,
        steps_per_s=means[median],
        per_rank=windows[median],
        windows=means,
        dummy_fraction=dummies / total if total else 0.0,
        collectives_per_s=collectives / DP_SIZE / elapsed,
    )


def rank_stats(client: Any) -> list[dict[str, int]]:
    return [client.call_utility(rank, "stats", timeout=TIMEOUT_S) for rank in range(DP_SIZE)]


def wait_stepping(probe: Any, steps: int, timeout: float = TIMEOUT_S) -> None:
    """Until every rank took ``steps`` steps (a lockstep rank first joins its gloo group)."""
    deadline = time.monotonic() + timeout
    while min(s["steps"] + s["dummy_steps"] for s in rank_stats(probe)) < steps:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the ranks did not take {steps} steps in {timeout}s")
        time.sleep(0.05)


def wait_done(handles: list[Any], timeout: float = 30.0) -> None:
    """Until every aborted handle has heard of it (the client caught up with its backlog)."""
    deadline = time.monotonic() + timeout
    for handle in handles:
        while not handle.done() and time.monotonic() < deadline:
            time.sleep(0.01)


def wait_paused(cluster: Any, timeout: float = 10.0) -> None:
    """Let a lockstep cluster finish its wave, so close() finds no rank in a collective."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and cluster.coordinator_state()["running"]:
        time.sleep(0.05)


def collective_floor_worker(rank: int, port: int, delays: list[float], window_s: float, results: Any) -> None:
    """One of 2 spawned processes: the steps/s of a bare loop, with and without a gloo all-reduce.

    Per delay: ``sleep(delay)`` alone, then ``sleep(delay); all_reduce(1 float)``
    (what EchoEngine's collective step does), each for ``window_s``. Rank 0
    ends the all-reduce loop through the reduced value, so both ranks stop
    on the same step.
    """
    import torch
    import torch.distributed as dist

    from raydp.engine.collective import GlooDPGroup

    GlooDPGroup(f"127.0.0.1:{port}", rank, DP_SIZE, timeout_s=TIMEOUT_S)
    try:
        for _ in range(BUSY_STEPS):
            dist.all_reduce(torch.ones(1))
        rates: dict[float, tuple[float, float]] = {}
        for delay in delays:
            dist.barrier()
            n, start = 0, time.perf_counter()
            while time.perf_counter() - start < window_s:
                if delay:
                    time.sleep(delay)
                n += 1
            alone = n / (time.perf_counter() - start)
            dist.barrier()
            n, start = 0, time.perf_counter()
            while True:
                if delay:
                    time.sleep(delay)
                go = torch.ones(1) if rank or time.perf_counter() - start < window_s else torch.zeros(1)
                dist.all_reduce(go, op=dist.ReduceOp.MIN)
                n += 1
                if go.item() == 0:
                    break
            rates[delay] = (alone, n / (time.perf_counter() - start))
        results.put((rank, rates))
    finally:
        dist.destroy_process_group()


def collective_floor(sizes: Sizes) -> dict[float, tuple[float, float]]:
    """Per delay: (bare loop steps/s, bare loop + gloo all-reduce steps/s), mean of 2 ranks."""
    from raydp.engine.collective import Rendezvous

    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    rendezvous = Rendezvous("127.0.0.1", DP_SIZE, timeout_s=TIMEOUT_S)
    port = rendezvous.store.port
    window = sizes.step_window_s * sizes.step_windows
    procs = [
        spawn.Process(target=collective_floor_worker, args=(rank, port, list(sizes.step_delays_s), window, results))
        for rank in range(DP_SIZE)
    ]
    for proc in procs:
        proc.start()
    try:
        per_rank = [results.get(timeout=TIMEOUT_S)[1] for _ in procs]
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
        rendezvous.close()
    return {
        delay: (statistics.fmean(r[delay][0] for r in per_rank), statistics.fmean(r[delay][1] for r in per_rank))
        for delay in sizes.step_delays_s
    }


def lockstep_benchmark(sizes: Sizes) -> tuple[list[StepRate], dict[float, tuple[float, float]] | str]:
    floor: dict[float, tuple[float, float]] | str
    log("step rate: bare loop and gloo all-reduce floor (2 processes, no raydp)")
    try:
        floor = collective_floor(sizes)
    except Exception as exc:
        floor = f"{type(exc).__name__}: {exc}"
    results = []
    for delay in sizes.step_delays_s:
        for i, mode in enumerate(MODES):
            log(f"step rate: {mode}, step_delay_s={delay}")
            try:
                results.append(step_rate(mode, delay, sizes, name=f"bench-step-{i}"))
            except Exception as exc:
                results.append(StepRate(mode, delay, error=f"{type(exc).__name__}: {exc}"))
    return results, floor


# ---- report ----------------------------------------------------------------------------------


def environment(sizes: Sizes, quick: bool) -> dict[str, Any]:
    from importlib.metadata import version

    import zmq

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
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


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a > 0 and b > 0 else "n/a"


def round_trip_table(results: list[RoundTrip], sizes: Sizes) -> list[str]:
    ours = results[0]
    lines = [
        f"### Request round trips (DP=2, prompt of {len(PROMPT)} tokens, max_tokens=1)",
        "",
        f"Pipelined: {sizes.pipelined} requests, {sizes.window} in flight. "
        f"Sequential: {sizes.sequential} requests one at a time.",
        "",
        "| system | pipelined req/s | raydp / it | sequential req/s | raydp / it | p50 ms | p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r.error is not None:
            lines.append(f"| {r.system} | failed: {r.error} | | | | | |")
            continue
        lines.append(
            f"| {r.system} | {r.pipelined_rps:,.0f} | {ratio(ours.pipelined_rps, r.pipelined_rps)} "
            f"| {r.sequential_rps:,.0f} | {ratio(ours.sequential_rps, r.sequential_rps)} "
            f"| {r.p50_ms:.2f} | {r.p99_ms:.2f} |"
        )
    others = [r for r in results[1:] if r.error is None]
    if ours.error is None and others:
        for kind, attr in (("pipelined", "pipelined_rps"), ("sequential", "sequential_rps")):
            parts = [f"{ratio(getattr(ours, attr), getattr(r, attr))} {r.system}" for r in others]
            lines += ["", f"{kind}: raydp is " + ", ".join(parts) + "."]
    lines += [
        "",
        "raydp's engine answers every request that arrived in one step with one message, so when "
        "pipelining it can match or beat the raw floor, which answers each request on its own.",
    ]
    return lines


def lockstep_table(results: list[StepRate], floor: dict[float, tuple[float, float]] | str, sizes: Sizes) -> list[str]:
    lines = [
        "### Lockstep overhead (DP=2, both ranks busy)",
        "",
        f"Steps per second per rank (steps + dummy steps), median of {sizes.step_windows} window(s) "
        f"of {sizes.step_window_s:g} s, allreduce_interval=32. EchoEngine's `step_delay_s` sleeps in every "
        f"step to stand in for device time ({sizes.busy_per_rank} running requests per rank). "
        f"`step_delay_s=0` is the worst case ({sizes.busy_per_rank_no_delay} requests per rank): the step is "
        "pure raydp + Python overhead, and the driver's client, decoding every output, competes for the "
        "same cores. "
        "The two floor columns run no raydp: 2 processes looping `sleep(step_delay_s)`, "
        "then `sleep(step_delay_s); all_reduce(1 float)` over gloo, as EchoEngine's collective step does.",
        "",
        "| step_delay_s | floor: bare loop | floor: loop + gloo all-reduce | dense | lockstep "
        "| lockstep + per-step all-reduce |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    rows = {(r.mode, r.step_delay_s): r for r in results}
    for delay in sizes.step_delays_s:
        alone, reduced = floor[delay] if isinstance(floor, dict) else (0.0, 0.0)
        cells = [
            "(sleep-free)" if delay == 0 and alone else rate_cell(alone, floor),
            rate_cell(reduced, floor),
        ]
        for mode in MODES:
            r = rows[(mode, delay)]
            cells.append(rate_cell(r.steps_per_s, r.error))
        lines.append(f"| {delay:g} | {' | '.join(cells)} |")
    lines += [
        "",
        "The issue's target is the first ratio: the same engine with lockstep on and off. The per-step "
        "all-reduce is the model's own collective (an expert-parallel forward pass), which a dense cluster "
        "cannot run; its columns say how much of that cost is gloo's rather than raydp's.",
        "",
        "| step_delay_s | **lockstep / dense** | >= 0.8 | lockstep + per-step all-reduce / dense "
        "| raydp cost: dense / bare loop | raydp cost: lockstep + all-reduce / gloo floor |",
        "|---:|---:|---|---:|---:|---:|",
    ]
    for delay in sizes.step_delays_s:
        dense, lock, coll = (rows[(m, delay)].steps_per_s for m in MODES)
        alone, reduced = floor[delay] if isinstance(floor, dict) else (0.0, 0.0)
        verdict = "n/a" if dense <= 0 or lock <= 0 else ("yes" if lock / dense >= 0.8 else "NO")
        lines.append(
            f"| {delay:g} | **{ratio(lock, dense)}** | {verdict} | {ratio(coll, dense)} "
            f"| {ratio(dense, alone) if delay else 'n/a'} | {ratio(coll, reduced)} |"
        )
    return lines


def rate_cell(rate: float, error: object) -> str:
    if isinstance(error, str):
        return f"failed: {error}"
    return f"{rate:,.0f}" if rate > 0 else "n/a"


@dataclass
class Report:
    """What one run measured; a section left out (``--only``, ``--skip``) stays None."""

    trips: list[RoundTrip] | None = None
    steps: list[StepRate] | None = None
    floor: dict[float, tuple[float, float]] | str | None = None
    http: list[HttpResult] | None = None

    def failed(self) -> bool:
        return (
            any(r.error for r in self.trips or [])
            or any(r.error for r in self.steps or [])
            or isinstance(self.floor, str)
            or (self.http is not None and http_failed(self.http))
        )

    def as_json(self, env: dict[str, Any], http_sizes: HttpSizes) -> dict[str, Any]:
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
        return payload


def run_sections(sections: list[str], sizes: Sizes, http_sizes: HttpSizes) -> Report:
    report = Report()
    if "round-trips" in sections:
        report.trips = round_trip_benchmark(sizes)
    if "lockstep" in sections:
        report.steps, report.floor = lockstep_benchmark(sizes)
    if "http" in sections:
        report.http = http_benchmark(http_sizes, log)
    return report


def print_report(env: dict[str, Any], report: Report, sizes: Sizes, http_sizes: HttpSizes) -> None:
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
    if report.trips is not None:
        print()
        print("\n".join(round_trip_table(report.trips, sizes)))
    if report.steps is not None and report.floor is not None:
        print()
        print("\n".join(lockstep_table(report.steps, report.floor, sizes)))
    if report.http is not None:
        print()
        print("\n".join(http_table(report.http, http_sizes)))


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test in about a minute")
    parser.add_argument("--only", action="append", choices=SECTIONS, metavar="SECTION",
                        help=f"run only this section (repeatable): {', '.join(SECTIONS)}")
    parser.add_argument("--skip", action="append", choices=SECTIONS, metavar="SECTION",
                        help="leave this section out (repeatable)")
    parser.add_argument("--json", metavar="PATH", help="also write every number to this JSON file")
    args = parser.parse_args(argv)
    sections = [s for s in SECTIONS if s in (args.only or SECTIONS) and s not in (args.skip or [])]
    if not sections:
        parser.error("--only and --skip leave no section to run")
    sizes = QUICK if args.quick else FULL
    http_sizes = HTTP_QUICK if args.quick else HTTP_FULL
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

    import ray

    env = environment(sizes, args.quick)
    env["sections"] = sections
    env["http_sizes"] = asdict(http_sizes)
    start = time.perf_counter()
    # address="local": always a fresh Ray of our own, never one found via RAY_ADDRESS
    # or /tmp/ray/ray_current_cluster (another user's cluster on this machine).
    ray.init(address="local", num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False)
    try:
        report = run_sections(sections, sizes, http_sizes)
    finally:
        ray.shutdown()
    env["wall_s"] = round(time.perf_counter() - start, 1)
    print_report(env, report, sizes, http_sizes)
    print()
    print(f"(ran in {env['wall_s']} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_json(env, http_sizes), indent=2) + "\n")
    return 1 if report.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
