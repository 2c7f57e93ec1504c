"""Request round trips: raydp against raw ZeroMQ + msgspec, Ray actor calls and Ray Serve handles."""

from __future__ import annotations

import contextlib
import multiprocessing
import shutil
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from benchmarks.common import DP_SIZE, ECHO_ENGINE, PROMPT, TIMEOUT_S, Sizes, quiet_serve_logs

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
    windows: list[float] = field(default_factory=list)  # pipelined req/s of each window (median reported)
    p50_windows: list[float] = field(default_factory=list)  # sequential p50 ms of each slice


# ---- the shared request loops --------------------------------------------------------


class EchoTarget(Protocol):
    """A system under test: ``send`` one tiny request, ``wait`` for its answer."""

    def send(self, i: int) -> Any: ...

    def wait(self, token: Any) -> None: ...


def run_pipelined(target: EchoTarget, n: int, window: int, min_s: float = 0.0, first: int = 0) -> float:
    """Keep ``window`` requests in flight for ``n`` requests and ``min_s`` at least; return requests per second.

    Request ``i`` is sent as ``target.send(first + i)``: runs given distinct ``first`` never reuse an id.
    """
    inflight: deque[Any] = deque()
    start = time.perf_counter()
    sent = 0
    while sent < n or time.perf_counter() - start < min_s:
        for _ in range(window):  # the clock is read once per window
            if len(inflight) >= window:
                target.wait(inflight.popleft())
            inflight.append(target.send(first + sent))
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


def measure_round_trips(system: str, target: EchoTarget, sizes: Sizes, rounds: int) -> RoundTrip:
    """One round of a system measured on its own: ``1 / rounds`` of the pipelined time and sequential
    requests that each system taking turns gets in all."""
    run_sequential(target, sizes.warmup, first=-sizes.warmup)
    pipelined = run_pipelined(target, sizes.pipelined, sizes.window, sizes.pipelined_s * sizes.turns / rounds)
    latencies = run_sequential(target, sizes.sequential * sizes.turns // rounds, first=10**9)  # past the ids above
    return round_trip_of(system, [pipelined], [latencies])


def round_trip_of(system: str, rates: list[float], slices: list[list[float]]) -> RoundTrip:
    """A system's figures from its pipelined windows' rates and its sequential slices' latencies."""
    latencies = [x for piece in slices for x in piece]
    if not latencies:  # batches only: no one-at-a-time figures
        return RoundTrip(system, pipelined_rps=statistics.median(rates), windows=rates)
    return RoundTrip(
        system,
        pipelined_rps=statistics.median(rates),
        sequential_rps=len(latencies) / sum(latencies),
        p50_ms=statistics.median(latencies) * 1e3,
        p99_ms=statistics.quantiles(latencies, n=100)[98] * 1e3,
        windows=rates,
        p50_windows=[statistics.median(piece) * 1e3 for piece in slices],
    )


def encoded_request(i: int) -> bytes:
    from raydp.wire.codec import encode
    from raydp.wire.protocol import Request

    return encode(Request(f"r{i}", PROMPT, 1))


def echo_reply(rank: int, body: bytes) -> bytes:
    """What every baseline server does: what EchoEngine answers for ``max_tokens=1``."""
    from raydp.wire.codec import encode
    from raydp.wire.protocol import Output, OutputBatch, request_decoder

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
def raydp_target(**fields: Any) -> Iterator[EchoTarget]:
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
