"""Request round trips: raydp against raw ZeroMQ + msgspec, Ray actor calls and Ray Serve handles."""

from __future__ import annotations

import contextlib
import multiprocessing
import shutil
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from bench_common import DP_SIZE, ECHO_ENGINE, PROMPT, TIMEOUT_S, Sizes, log, quiet_serve_logs, ratio

STOP_TAG = b"\xff"


@dataclass
class RoundTrip:
    """One system's request round trips."""

    system: str
    pipelined_rps: float = 0.0
    sequential_rps: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    error: str | None = None
    rounds: list[float] = field(default_factory=list)  # pipelined req/s of each round (median reported)
    p50_rounds: list[float] = field(default_factory=list)


# ---- the shared request loops --------------------------------------------------------


class EchoTarget(Protocol):
    """A system under test: ``send`` one tiny request, ``wait`` for its answer."""

    def send(self, i: int) -> Any: ...

    def wait(self, token: Any) -> None: ...


def run_pipelined(target: EchoTarget, n: int, window: int, min_s: float = 0.0) -> float:
    """Keep ``window`` requests in flight for ``n`` requests and ``min_s`` at least; return requests per second."""
    inflight: deque[Any] = deque()
    start = time.perf_counter()
    sent = 0
    while sent < n or time.perf_counter() - start < min_s:
        for _ in range(window):  # the clock is read once per window
            if len(inflight) >= window:
                target.wait(inflight.popleft())
            inflight.append(target.send(sent))
            sent += 1
    while inflight:
        target.wait(inflight.popleft())
    return sent / (time.perf_counter() - start)


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
    pipelined = run_pipelined(target, sizes.pipelined, sizes.window, sizes.pipelined_s)
    latencies = run_sequential(target, sizes.sequential, first=10**9)  # ids past the pipelined run's
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
    output = Output(request.request_id, request.prompt_token_ids[:1], True, "length", seq=request.seq)
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


ROUNDS = 3  # every system runs once per round; the report gives medians and the spread


def round_trip_benchmark(sizes: Sizes, rounds: int = ROUNDS) -> list[RoundTrip]:
    """Every system once per round, rounds interleaved: a slow minute of the machine hits them all.

    The figures of each system are its medians over the rounds; ``rounds``
    keeps each round's pipelined rate, so the table can give the spread.
    """
    from bench_pipe import pipe_target, submit_many_round_trips

    many = f"raydp submit_many (DP=2, batches of {sizes.window})"
    systems: list[tuple[str, Callable[[], RoundTrip]]] = [
        ("raydp (DP=2)", lambda: _measure("raydp (DP=2)", raydp_target, sizes)),
        (many, lambda: _guarded(many, lambda: submit_many_round_trips(many, sizes))),
    ]
    for system, make in [
        ("raydp over TCP + CURVE (the cross-node path)", lambda: raydp_target(transport="tcp")),
        ("raydp over TCP, auth='none'", lambda: raydp_target(transport="tcp", auth="none")),
        ("raw ZMQ + msgspec (2 server procs)", zmq_target),
        ("raw ZMQ PUSH/PULL + msgspec, one pipe (the second floor)", pipe_target),
        ("Ray actor calls (2 actors)", lambda: ray_actor_target(placement_groups=False)),
        ("Ray actors in STRICT_PACK PGs", lambda: ray_actor_target(placement_groups=True)),
        ("Ray Serve (2 replicas, handle)", lambda: serve_target(sizes.window)),
    ]:
        systems.append((system, lambda s=system, m=make: _measure(s, m, sizes)))  # type: ignore[misc]
    runs: dict[str, list[RoundTrip]] = {name: [] for name, _ in systems}
    # Untimed: whatever ran first after ray.init measured 3-6x slow (Ray was still
    # starting its worker pool and agents), which once passed for an IPC deficit.
    log("round trips: warm-up (untimed)")
    _measure("warm-up", raydp_target, sizes)
    for n in range(rounds):
        for system, measure in systems:
            log(f"round trips, round {n + 1}/{rounds}: {system}")
            runs[system].append(measure())
    return [_median_of(system, found) for system, found in runs.items()]


def _guarded(system: str, run: Callable[[], RoundTrip]) -> RoundTrip:
    try:
        return run()
    except Exception as exc:
        return RoundTrip(system, error=f"{type(exc).__name__}: {exc}")


def _measure(
    system: str, make: Callable[[], contextlib.AbstractContextManager[EchoTarget]], sizes: Sizes
) -> RoundTrip:
    try:
        with make() as target:
            return measure_round_trips(system, target, sizes)
    except Exception as exc:
        return RoundTrip(system, error=f"{type(exc).__name__}: {exc}")


def _median_of(system: str, found: list[RoundTrip]) -> RoundTrip:
    ok = [r for r in found if r.error is None]
    if not ok:
        return found[0]

    def med(attr: str) -> float:
        return float(statistics.median(getattr(r, attr) for r in ok))

    return RoundTrip(system, med("pipelined_rps"), med("sequential_rps"), med("p50_ms"), med("p99_ms"),
                     rounds=[r.pipelined_rps for r in ok], p50_rounds=[r.p50_ms for r in ok])


def _spread(values: list[float]) -> str:
    return f"{min(values):,.0f} - {max(values):,.0f}" if len(values) > 1 else "-"


def _ratio_range(a: RoundTrip, b: RoundTrip, attr: str = "rounds") -> str:
    """The ratio's median over rounds, and its range (rounds are paired by index)."""
    pairs = [x / y for x, y in zip(getattr(a, attr), getattr(b, attr), strict=False) if y]
    if len(pairs) < 2:
        return ""
    return f" (median over rounds {statistics.median(pairs):.2f}, range {min(pairs):.2f} - {max(pairs):.2f})"


def _floor_ratios(results: list[RoundTrip]) -> list[str]:
    """The issue's targets: raydp against both floors (and over TCP), with their spread over rounds."""
    ours = next((r for r in results if r.system == "raydp (DP=2)" and not r.error), None)
    floor = next((r for r in results if r.system.startswith("raw ZMQ + msgspec") and not r.error), None)
    pipe = next((r for r in results if "one pipe" in r.system and not r.error), None)
    many = next((r for r in results if "submit_many" in r.system and not r.error), None)
    tcp = next((r for r in results if r.system.startswith("raydp over TCP + CURVE") and not r.error), None)
    lines = [""]
    if ours and floor:
        lines.append(f"Targets: same-node IPC pipelined / raw floor = {ours.pipelined_rps / floor.pipelined_rps:.2f} "
                     f"(>= 0.9){_ratio_range(ours, floor)}; sequential p50 / raw floor p50 = "
                     f"{ours.p50_ms / floor.p50_ms:.2f} (<= 1.3){_ratio_range(ours, floor, 'p50_rounds')}")
    if ours and tcp:
        lines.append(f"same-node IPC / TCP+CURVE pipelined = {ours.pipelined_rps / tcp.pipelined_rps:.2f} "
                     f"(>= 1){_ratio_range(ours, tcp)}")
    if many and pipe:
        lines.append(f"submit_many / one raw pipe = {many.pipelined_rps / pipe.pipelined_rps:.2f} "
                     f"(>= 0.3){_ratio_range(many, pipe)}")
    return lines


# ---- benchmark 2 ---------------------------------------------------------------------------


def round_trip_table(results: list[RoundTrip], sizes: Sizes) -> list[str]:
    ours = results[0]
    lines = [
        f"### Request round trips (DP=2, prompt of {len(PROMPT)} tokens, max_tokens=1)",
        "",
        f"Pipelined: {sizes.pipelined_s:g} s and {sizes.pipelined:,} requests at least, {sizes.window} in flight. "
        f"Sequential: {sizes.sequential} requests one at a time.",
        "",
        "| system | pipelined req/s | min - max | raydp / it | sequential req/s | raydp / it | p50 ms | p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r.error is not None:
            lines.append(f"| {r.system} | failed: {r.error} | | | | | | |")
            continue
        if not r.sequential_rps:  # batches only: no one-at-a-time figures
            lines.append(f"| {r.system} | {r.pipelined_rps:,.0f} | {_spread(r.rounds)} "
                         f"| {ratio(ours.pipelined_rps, r.pipelined_rps)} | - | - | - | - |")
            continue
        lines.append(
            f"| {r.system} | {r.pipelined_rps:,.0f} | {_spread(r.rounds)} "
            f"| {ratio(ours.pipelined_rps, r.pipelined_rps)} | {r.sequential_rps:,.0f} "
            f"| {ratio(ours.sequential_rps, r.sequential_rps)} | {r.p50_ms:.2f} | {r.p99_ms:.2f} |"
        )
    lines += _floor_ratios(results)
    others = [r for r in results[1:] if r.error is None and r.sequential_rps]
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
