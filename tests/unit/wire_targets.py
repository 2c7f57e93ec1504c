"""Fuzz targets on real sockets, and what the fuzz tests share (``test_wire_fuzz``, ``test_http_fuzz``).

Each target is a real component on loopback TCP, CURVE-secured or not:
the coordinator loop (:func:`coordinator`), an engine loop with EchoEngine
(:func:`engine`), a client under a PUB the test binds (:func:`stats_target`).
``settle`` on each sends a real message behind the fuzz and waits for its
effect, so everything sent before it has been handled. :func:`serve_component`
runs one of them in a spawned process for the flood tests.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import psutil
import pytest
import zmq
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from raydp.client.client import Client
from raydp.coordinator.loop import CoordinatorLoop
from raydp.coordinator.state import CoordinatorState
from raydp.engine.core import EngineContext
from raydp.engine.loop import EngineLoop
from raydp.engine.sockets import EngineSockets
from raydp.errors import ProtocolError
from raydp.models.echo import EchoEngine
from raydp.wire.blocks import CacheEvents
from raydp.wire.codec import encode
from raydp.wire.control import (
    BROADCAST_TOPIC,
    CacheReport,
    CacheWanted,
    EngineDead,
    EngineRevived,
    EngineStats,
    FirstRequest,
    HoldAck,
    HoldCluster,
    RegroupCluster,
    Regrouped,
    ReleaseCluster,
    ScaleEngines,
    Shutdown,
    StartDPWave,
    StartWave,
    StatsSnapshot,
    WaveComplete,
    coordinator_decoder,
    snapshot_decoder,
)
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint
from raydp.wire.protocol import (
    Abort,
    EngineAddresses,
    Hello,
    Init,
    Output,
    OutputBatch,
    ParallelConfig,
    Ready,
    Reject,
    Request,
    RequestBatch,
    RequestType,
    UtilityCall,
    decode_input,
    output_decoder,
)
from raydp.wire.security import CurveKeys, guard
from raydp.wire.transport import SocketOptions, make_socket
from tests.unit.loop_thread import in_thread, run_loop

MAX_BYTES = 1 << 20  # every fuzzed target's maximum message size
KEYS = CurveKeys.generate()  # the cluster's keys in every CURVE case
STRANGER = CurveKeys.generate()  # keys of nobody in the cluster
AUTH = ("plain", "curve")
# The targets keep state from one example to the next, so a failure is reported as found, not shrunk
# (shrinking would replay examples against a target the failure already changed, or killed).
FUZZ = settings(
    max_examples=25,
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
BURST = 20  # DropLog's default: lines per second over all senders
RSS_SLACK = 48 << 20  # generous: the point is "bounded", not a budget


def server_opts(auth: str) -> SocketOptions:
    return SocketOptions(max_message_bytes=MAX_BYTES, curve=KEYS if auth == "curve" else None)


def member_opts(auth: str) -> SocketOptions:
    return SocketOptions(curve=KEYS if auth == "curve" else None)


OUTSIDERS = {  # what a peer without the cluster's keys can present to a CURVE socket
    "no keys": SocketOptions(),
    "a stranger's member key": SocketOptions(
        curve=CurveKeys(KEYS.server_public, b"", STRANGER.member_public, STRANGER.member_secret)
    ),
}


# ---- frames ---------------------------------------------------------------------------

SAMPLES: list[msgspec.Struct] = [  # one real message of each kind, for every socket
    Request("r1", [1, 2, 3], 4),
    RequestBatch([Request("r2", [4], 2)]),
    Abort(["r1"]),
    UtilityCall(1, "describe"),
    OutputBatch(0, [Output("r1", [1], True, "length")]),
    EngineStats(0, 1, 2),
    WaveComplete(0, 1),
    StartWave(0, 1),
    FirstRequest(0, 1),
    ScaleEngines(4, 4),
    EngineDead(3, "killed"),
    EngineRevived(3, ["ipc:///nowhere"], "n"),
    HoldCluster(1, 2),
    HoldAck(0, 1, 1, True),
    RegroupCluster(1, 2, "tcp://127.0.0.1:1"),
    Regrouped(0, 1),
    ReleaseCluster(1),
    CacheReport(1, 7, 1, CacheEvents(16, [5], [6], queried=32, hits=16)),
    CacheWanted(0),
    StatsSnapshot([(1, 2)], 3, True, 4),
    StartDPWave(1),
    Shutdown(),
    Hello(True),
    Init(EngineAddresses("ipc://a", "ipc://b"), ParallelConfig(1, 1, False, 32)),
    Ready(1, "h", ["ipc://a"]),
    Reject("no"),
]
ENCODED = [encode(m) for m in SAMPLES]
INT64 = st.integers(-(2**63), 2**64 - 1)  # every int msgpack carries
scalars = st.none() | st.booleans() | INT64 | st.floats() | st.text(max_size=12) | st.binary(max_size=12)
msgpack_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5) | st.integers(0, 9), inner, max_size=4)
    ),
    max_leaves=20,
)
truncated = st.sampled_from(ENCODED).flatmap(lambda b: st.integers(0, len(b) - 1).map(lambda n: b[:n]))
bodies = st.one_of(
    st.binary(max_size=300), truncated, msgpack_values.map(msgspec.msgpack.encode), st.sampled_from(ENCODED)
)
messages = st.lists(bodies, min_size=1, max_size=4)  # one message: its frames
engine_inputs = st.one_of(  # what a client DEALER sends: mostly [tag, body]
    st.tuples(st.sampled_from([t.value for t in RequestType]) | st.binary(max_size=3), bodies).map(list), messages
)


def decodes(decoder: Callable[[bytes], Any], body: bytes) -> bool:
    try:
        decoder(body)
    except ProtocolError:
        return False
    return True


def coordinator_drops(parts: list[bytes]) -> bool:
    return len(parts) != 1 or not decodes(coordinator_decoder, parts[0])


def engine_drops(parts: list[bytes]) -> bool:
    return len(parts) != 2 or not decodes(lambda b: decode_input(parts[0], b), parts[1])


def client_drops(parts: list[bytes]) -> bool:
    return len(parts) != 1 or not decodes(snapshot_decoder, parts[0])


# ---- shared helpers ----------------------------------------------------------------------


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.002)
    return predicate()


def drop_lines(caplog: pytest.LogCaptureFixture, component: str) -> list[str]:
    """Every line a DropLog of ``component`` wrote."""
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"{component}: dropped a ")]


def rate_bound(senders: int, elapsed_s: float) -> int:
    """The most lines DropLog may write in ``elapsed_s``: one a second per sender, BURST a second in all."""
    return min(senders, BURST) * (math.ceil(elapsed_s) + 1)


@contextlib.contextmanager
def zmq_context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


def connect(
    ctx: zmq.Context[zmq.Socket[bytes]], kind: int, opts: SocketOptions, address: str, identity: bytes | None = None
) -> zmq.Socket[bytes]:
    sock = make_socket(ctx, kind, opts, identity=identity)
    sock.connect(address)
    return sock


def offer(sock: zmq.Socket[bytes], *parts: bytes) -> None:
    """Send an outsider's message if its socket still takes one. ZeroMQ drops a connection refused at its
    handshake together with its queue, so a sender refused before this call (a loaded machine runs the IO
    thread first) has nowhere to put it and raises ``zmq.Again``: nothing is sent, nothing can arrive."""
    with contextlib.suppress(zmq.Again):
        sock.send_multipart(list(parts), flags=zmq.NOBLOCK)


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return drop_lines(caplog, "gatekeeper")


def assert_stranger_refused_and_logged_once_a_second(caplog: pytest.LogCaptureFixture, since: float) -> None:
    """The stranger's refusal is logged, at most once a second since it first connected (at ``since``)."""

    def lines() -> list[str]:
        return [line for line in refusals(caplog) if STRANGER.member_public.decode() in line]

    # Waited for, not assumed after a fixed sleep: a loaded machine may run the gatekeeper's thread late.
    assert wait_until(lambda: bool(lines()), timeout=30), "the gatekeeper names the refused key"
    elapsed_s = time.monotonic() - since
    assert len(lines()) <= rate_bound(1, elapsed_s), f"{len(lines())} refusal lines in {elapsed_s:.1f}s: one a second"


# ---- the coordinator's collect PULL --------------------------------------------------------


@dataclass
class CoordinatorTarget:
    loop: CoordinatorLoop
    thread: threading.Thread
    errors: list[BaseException]
    marks: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    @property
    def collect(self) -> str:
        return self.loop.endpoints.collect[0]

    def settle(self, push: zmq.Socket[bytes]) -> None:
        """Send a marker behind what ``push`` sent; return once the loop applied it (so all before it)."""
        mark = next(self.marks)
        push.send(encode(EngineStats(rank=0, waiting=0, running=mark)))

        def applied() -> bool:
            return self.loop.describe().counts[0] == [0, mark]

        wait_until(lambda: applied() or not self.thread.is_alive())
        self.assert_alive()
        assert applied(), "the marker was not applied"

    def assert_alive(self) -> None:
        assert self.thread.is_alive() and self.errors == [], self.errors

    def assert_publishes(self, ctx: zmq.Context[zmq.Socket[bytes]], auth: str, push: zmq.Socket[bytes]) -> None:
        """A real report still reaches a real subscriber's snapshot."""
        sub = connect(ctx, zmq.SUB, member_opts(auth), self.loop.endpoints.publish[0])
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        push.send(encode(ScaleEngines(4, 4)))  # the fuzz may have resized the cluster
        push.send(encode(EngineStats(rank=1, waiting=7, running=3)))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if sub.poll(100) and snapshot_decoder(sub.recv()).counts[1:2] == [(7, 3)]:
                return
        raise AssertionError("no snapshot carried the report sent after the fuzz")


@contextlib.contextmanager
def coordinator(auth: str) -> Iterator[CoordinatorTarget]:
    loop = CoordinatorLoop(
        CoordinatorState(4, stats_interval_s=0.01, heartbeat_interval_s=0.05),
        server_opts(auth),
        transport="tcp",
        ip="127.0.0.1",
        node_id="n0",
    )
    thread, errors = in_thread(loop.run)
    try:
        yield CoordinatorTarget(loop, thread, errors)
    finally:
        loop.close()


# ---- an engine's input ROUTER --------------------------------------------------------------


@dataclass
class EngineTarget:
    ctx: zmq.Context[zmq.Socket[bytes]]
    loop: EngineLoop
    thread: threading.Thread
    errors: list[BaseException]
    address: str
    broadcast: zmq.Socket[bytes]
    calls: Iterator[int] = field(default_factory=lambda: itertools.count(10**6))

    def settle(self, dealer: zmq.Socket[bytes]) -> dict[str, int]:
        """A utility call behind what ``dealer`` sent; its answer means all before it was handled."""
        call_id = next(self.calls)
        dealer.send_multipart([RequestType.UTILITY.value, encode(UtilityCall(call_id, "raydp_counters"))])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            self.assert_alive()
            if dealer.poll(100):
                batch = output_decoder(dealer.recv())
                if batch.utility is not None and batch.utility.call_id == call_id:
                    return dict(batch.utility.result)
        raise AssertionError("the engine did not answer a utility call")

    def assert_alive(self) -> None:
        assert self.thread.is_alive() and self.errors == [], self.errors

    def assert_answers(self, ctx: zmq.Context[zmq.Socket[bytes]], auth: str) -> None:
        """A real client's real request still gets its right tokens."""
        real = connect(ctx, zmq.DEALER, member_opts(auth), self.address, identity=b"c-real-" + random.randbytes(4))
        real.send_multipart([RequestType.ADD.value, encode(Request("real", [5, 6], 3))])
        tokens: list[int] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(tokens) < 3:
            if real.poll(100):
                outputs = output_decoder(real.recv()).outputs
                tokens += [t for o in outputs if o.request_id == "real" for t in o.token_ids]
        assert tokens == [5, 6, 5]

    def stop(self) -> None:
        self.broadcast.send_multipart([BROADCAST_TOPIC, encode(Shutdown())])
        self.thread.join(timeout=10)


def start_engine(auth: str, ctx: zmq.Context[zmq.Socket[bytes]]) -> EngineTarget:
    """A real engine loop (EchoEngine) whose input ROUTER listens on loopback TCP, CURVE-secured with ``auth``."""
    inproc = SocketOptions()
    collect = make_socket(ctx, zmq.PULL, inproc)
    collect.bind("inproc://fuzz-collect")
    broadcast = make_socket(ctx, zmq.XPUB, inproc)
    broadcast.bind("inproc://fuzz-broadcast")
    inputs = make_socket(ctx, zmq.ROUTER, server_opts(auth), serves=True)
    address = f"tcp://127.0.0.1:{inputs.bind_to_random_port('tcp://127.0.0.1')}"
    sockets = EngineSockets(
        ctx,
        [inputs],
        connect(ctx, zmq.PUSH, inproc, "inproc://fuzz-collect"),
        connect(ctx, zmq.SUB, inproc, "inproc://fuzz-broadcast"),
        rank=0,
    )
    loop = EngineLoop(EchoEngine(EngineContext(0, 0, 1, 1, "n")), 0, sockets, stats_interval_s=0.01)
    thread, errors = run_loop(loop, sockets, broadcast)
    return EngineTarget(ctx, loop, thread, errors, address, broadcast)


@contextlib.contextmanager
def engine(auth: str) -> Iterator[EngineTarget]:
    with zmq_context() as ctx:
        gate = guard(ctx, KEYS if auth == "curve" else None)
        target = start_engine(auth, ctx)
        try:
            yield target
        finally:
            target.stop()
            if gate is not None:
                gate.stop()


# ---- a client's stats SUB -------------------------------------------------------------------


@dataclass
class StatsTarget:
    client: Client
    pub: zmq.Socket[bytes]
    marks: Iterator[int] = field(default_factory=lambda: itertools.count(10**9))

    def settle(self) -> None:
        """Publish a marker snapshot until the client holds it (the first time, the SUB is still joining)."""
        mark = next(self.marks)
        marker = encode(StatsSnapshot([(0, 0)], 0, False, seq=mark))

        def seen() -> bool:
            assert self.client._turns.thread.is_alive(), "the client's IO thread died"
            self.pub.send(marker)
            snap = self.client.snapshot()
            return wait_until(lambda: (s := self.client.snapshot()) is not None and s.seq == mark, 0.1) or (
                snap is not None and snap.seq == mark
            )

        assert wait_until(seen, timeout=15), "a valid snapshot no longer reaches the client"

    def dropped(self) -> int:
        return self.client._router._drops.dropped


@contextlib.contextmanager
def stats_target(auth: str, pub_opts: SocketOptions | None = None) -> Iterator[StatsTarget]:
    """A real client whose coordinator is a PUB this test binds (``pub_opts``: an impostor's socket)."""
    with zmq_context() as ctx:
        gate = guard(ctx, KEYS if auth == "curve" else None)
        pub = make_socket(ctx, zmq.PUB, pub_opts or server_opts(auth), serves=True)
        engine = make_socket(ctx, zmq.ROUTER, server_opts(auth), serves=True)
        collect = make_socket(ctx, zmq.PULL, server_opts(auth), serves=True)
        address = {s: f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}" for s in (pub, engine, collect)}
        endpoints = ClusterEndpoints(
            "fuzz",
            [EngineEndpoint(0, "n", [address[engine]])],
            CoordinatorEndpoints("n", [address[pub]], [address[collect]], [address[collect]]),
            lockstep=False,
            curve=KEYS if auth == "curve" else None,
        )
        client = Client(endpoints, node_id="n", follow_liveness=False)
        try:
            yield StatsTarget(client, pub)
        finally:
            client.close()
            if gate is not None:
                gate.stop()


# ---- floods, in processes of their own --------------------------------------------------------


class _CountDrops(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += "dropped" in record.getMessage()


def serve_component(kind: str, publish: str, conn: Connection) -> None:
    """Child process: run one component on loopback TCP and answer ``measure`` until ``stop``."""
    counter = _CountDrops()
    logging.getLogger().addHandler(counter)  # instead of stderr: only the count matters here
    logging.getLogger().setLevel(logging.WARNING)
    with contextlib.ExitStack() as stack:
        if kind == "coordinator":
            target = stack.enter_context(coordinator("plain"))
            conn.send(target.collect)
            alive: Callable[[], bool] = target.thread.is_alive
            drops: Callable[[], int] = lambda: target.loop.dropped  # noqa: E731
        elif kind == "engine":
            eng = stack.enter_context(engine("plain"))
            conn.send(eng.address)
            alive = eng.thread.is_alive
            drops = lambda: eng.loop._drops.dropped  # noqa: E731
        else:
            ctx = stack.enter_context(zmq_context())
            engine_stub = make_socket(ctx, zmq.ROUTER, SocketOptions())
            collect = make_socket(ctx, zmq.PULL, SocketOptions())
            stub = {s: f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}" for s in (engine_stub, collect)}
            client = Client(
                ClusterEndpoints(
                    "flood",
                    [EngineEndpoint(0, "n", [stub[engine_stub]])],
                    CoordinatorEndpoints("n", [publish], [stub[collect]], [stub[collect]]),
                    lockstep=False,
                ),
                node_id="n",
                follow_liveness=False,
            )
            stack.callback(client.close)
            conn.send(publish)
            alive = client._turns.thread.is_alive
            drops = lambda: client._router._drops.dropped  # noqa: E731
        while conn.recv() != "stop":
            gc.collect()
            conn.send(
                {
                    "rss": psutil.Process().memory_info().rss,
                    "drops": drops(),
                    "records": counter.count,
                    "alive": alive(),
                    "heard": kind != "client" or client.snapshot() is not None,
                }
            )


@dataclass
class Flood:
    """Garbage that never decodes (0xc1 is no msgpack byte), from several senders in turn."""

    kind: str
    senders: list[zmq.Socket[bytes]]
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def send(self, count: int) -> None:
        for i in range(count):
            junk = b"\xc1" + self.rng.randbytes(self.rng.randrange(64))
            parts = [junk] if i % 3 else [junk, b"more", b"frames"]
            if self.kind == "engine" and i % 3 == 1:
                parts = [b"\x09", junk]  # a [tag, body] pair with an unknown tag
            self.senders[i % len(self.senders)].send_multipart(parts)


def measure(conn: Connection, until: Callable[[dict[str, Any]], bool], timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        conn.send("measure")
        assert conn.poll(timeout), "the component stopped answering"
        state: dict[str, Any] = conn.recv()
        if until(state) or time.monotonic() > deadline:
            return state
        time.sleep(0.05)
