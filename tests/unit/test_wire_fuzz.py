"""Wire fuzzing: generated, truncated and misshapen frames on every socket a peer can reach.

Real ZMQ sockets and real loops, no Ray and no mocks: the handshake ROUTER
(``HandshakeServer.run``), an engine's input ROUTER (the real ``EngineLoop``
with ``EchoEngine``), the coordinator's collect PULL (the real
``CoordinatorLoop``), a client's stats SUB (a real ``Client`` under a PUB the
test binds), and the HTTP server (the real app over a real client and engine,
on a loopback socket). Each ZMQ target is fuzzed without auth and with CURVE:
an outsider is refused before anything is decoded, a member's garbage is dropped.

After each fuzz the target still gives the right answer; each dropped message
counts once, never once per frame; its log line names the sender; and a flood
is rate limited (``raydp.wire.dropped``). The floods run the coordinator, an
engine and a client in spawned processes, so their RSS is measured alone.
"""

from __future__ import annotations

import contextlib
import gc
import http.client
import itertools
import json
import logging
import math
import multiprocessing
import random
import re
import socket
import string
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
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from raydp.client.client import Client
from raydp.coordinator.loop import CoordinatorLoop
from raydp.coordinator.state import CoordinatorState
from raydp.engine.core import EchoEngine, EngineContext
from raydp.engine.loop import EngineLoop, EngineSockets
from raydp.errors import ProtocolError
from raydp.serve.app import build_app
from raydp.serve.server import serve_on_socket
from raydp.wire.dropped import MAX_REASON_CHARS, DropLog
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint
from raydp.wire.handshake import HandshakeServer, engine_handshake
from raydp.wire.protocol import (
    BROADCAST_TOPIC,
    Abort,
    EngineAddresses,
    EngineDead,
    EngineRevived,
    EngineStats,
    FirstRequest,
    Hello,
    HoldAck,
    HoldCluster,
    Init,
    Output,
    OutputBatch,
    ParallelConfig,
    Ready,
    RegroupCluster,
    Regrouped,
    Reject,
    ReleaseCluster,
    Request,
    RequestBatch,
    RequestType,
    ScaleEngines,
    Shutdown,
    StartDPWave,
    StartWave,
    StatsSnapshot,
    UtilityCall,
    WaveComplete,
    coordinator_decoder,
    decode_input,
    encode,
    handshake_decoder,
    output_decoder,
    rank_identity,
    snapshot_decoder,
)
from raydp.wire.security import CurveKeys, guard
from raydp.wire.transport import SocketOptions, make_socket

pytestmark = pytest.mark.timeout(90)

MAX_BYTES = 1 << 20  # every fuzzed target's maximum message size
KEYS = CurveKeys.generate()  # the cluster's keys in every CURVE case
STRANGER = CurveKeys.generate()  # keys of nobody in the cluster
AUTH = ("plain", "curve")
# The targets keep state from one example to the next, so a failure is reported as found, not shrunk
# (shrinking would replay examples against a target the failure already changed, or killed).
FUZZ = settings(max_examples=25, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BURST = 20  # DropLog's default: lines per second over all senders
RSS_SLACK = 48 << 20  # generous: the point is "bounded", not a budget


def server_opts(auth: str) -> SocketOptions:
    return SocketOptions(max_message_bytes=MAX_BYTES, curve=KEYS if auth == "curve" else None)


def member_opts(auth: str) -> SocketOptions:
    return SocketOptions(curve=KEYS if auth == "curve" else None)


OUTSIDERS = {  # what a peer without the cluster's keys can present to a CURVE socket
    "no keys": SocketOptions(),
    "a stranger's member key": SocketOptions(
        curve=CurveKeys(KEYS.server_public, b"", STRANGER.member_public, STRANGER.member_secret)),
}


# ---- frames ---------------------------------------------------------------------------

SAMPLES: list[msgspec.Struct] = [  # one real message of each kind, for every socket
    Request("r1", [1, 2, 3], 4), RequestBatch([Request("r2", [4], 2)]), Abort(["r1"]), UtilityCall(1, "describe"),
    OutputBatch(0, [Output("r1", [1], True, "length")]), EngineStats(0, 1, 2), WaveComplete(0, 1),
    StartWave(0, 1), FirstRequest(0, 1), ScaleEngines(4, 4), EngineDead(3, "killed"),
    EngineRevived(3, ["ipc:///nowhere"], "n"), HoldCluster(1, 2), HoldAck(0, 1, 1, True),
    RegroupCluster(1, 2, "tcp://127.0.0.1:1"), Regrouped(0, 1), ReleaseCluster(1),
    StatsSnapshot([(1, 2)], 3, True, 4), StartDPWave(1), Shutdown(), Hello(True),
    Init(EngineAddresses("ipc://a", "ipc://b"), ParallelConfig(1, 1, False, 32)), Ready(1, "h", ["ipc://a"]),
    Reject("no"),
]
ENCODED = [encode(m) for m in SAMPLES]
INT64 = st.integers(-(2**63), 2**64 - 1)  # every int msgpack carries
scalars = st.none() | st.booleans() | INT64 | st.floats() | st.text(max_size=12) | st.binary(max_size=12)
msgpack_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5) | st.integers(0, 9), inner,
                                                                max_size=4),
    max_leaves=20,
)
truncated = st.sampled_from(ENCODED).flatmap(lambda b: st.integers(0, len(b) - 1).map(lambda n: b[:n]))
bodies = st.one_of(st.binary(max_size=300), truncated, msgpack_values.map(msgspec.msgpack.encode),
                   st.sampled_from(ENCODED))
messages = st.lists(bodies, min_size=1, max_size=4)  # one message: its frames
engine_inputs = st.one_of(  # what a client DEALER sends: mostly [tag, body]
    st.tuples(st.sampled_from([t.value for t in RequestType]) | st.binary(max_size=3), bodies).map(list), messages)


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


def connect(ctx: zmq.Context[zmq.Socket[bytes]], kind: int, opts: SocketOptions, address: str,
            identity: bytes | None = None) -> zmq.Socket[bytes]:
    sock = make_socket(ctx, kind, opts, identity=identity)
    sock.connect(address)
    return sock


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return drop_lines(caplog, "gatekeeper")


def assert_stranger_refused_and_logged_once_a_second(caplog: pytest.LogCaptureFixture, elapsed_s: float) -> None:
    lines = [line for line in refusals(caplog) if STRANGER.member_public.decode() in line]
    assert lines, "the gatekeeper names the refused key"
    assert len(lines) <= rate_bound(1, elapsed_s), f"{len(lines)} refusal lines in {elapsed_s:.1f}s: one per retry"


# ---- DropLog itself, on a clock the test moves ----------------------------------------------

@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def drop_log(caplog: pytest.LogCaptureFixture, **limits: int) -> tuple[DropLog, Clock]:
    caplog.set_level(logging.WARNING, logger="test.drops")
    clock = Clock()
    return DropLog(logging.getLogger("test.drops"), "unit", clock=clock, **limits), clock


def test_a_sender_gets_one_line_a_second_and_the_next_one_counts_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    drops, clock = drop_log(caplog)
    for _ in range(5):
        drops.drop("peer a", "bad")
    clock.now = 0.99
    drops.drop("peer a", "bad")
    clock.now = 1.0
    drops.drop("peer a", "worse")
    assert drops.dropped == 7
    assert drop_lines(caplog, "unit") == [
        "unit: dropped a malformed message from peer a: bad",
        "unit: dropped a malformed message from peer a: worse (5 more from this sender not logged)",
    ]


def test_many_senders_share_a_burst_and_the_table_stays_small(caplog: pytest.LogCaptureFixture) -> None:
    drops, clock = drop_log(caplog, burst=3, max_senders=4)
    for i in range(10):  # ten senders at once: three lines, seven held back
        drops.drop(f"peer {i}", "bad")
    clock.now = 1.0
    drops.drop("peer x", "bad")
    lines = drop_lines(caplog, "unit")
    assert len(lines) == 4 and lines[-1].endswith("(7 more from other senders not logged)")
    for i in range(1000):  # a new identity per message, slowly: every one is logged, none is kept long
        clock.now += 1.0
        drops.drop(f"rotating {i}", "bad")
    assert len(drops._senders) <= 4 and drops.dropped == 1011


def test_a_long_reason_is_cut(caplog: pytest.LogCaptureFixture) -> None:
    drops, _ = drop_log(caplog)
    drops.drop("peer a", "x" * 100_000)
    (line,) = drop_lines(caplog, "unit")
    assert len(line) < MAX_REASON_CHARS + 100


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
            return self.loop.describe()["counts"][0] == [0, mark]

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
    loop = CoordinatorLoop(CoordinatorState(4, stats_interval_s=0.01, heartbeat_interval_s=0.05), server_opts(auth),
                           transport="tcp", ip="127.0.0.1", node_id="n0")
    errors: list[BaseException] = []

    def run() -> None:
        try:
            loop.run()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield CoordinatorTarget(loop, thread, errors)
    finally:
        loop.close()


@pytest.mark.parametrize("auth", AUTH)
def test_coordinator_collect_survives_fuzz_and_counts_each_bad_message_once(
    auth: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    with coordinator(auth) as target, zmq_context() as ctx:
        push = connect(ctx, zmq.PUSH, member_opts(auth), target.collect)
        target.settle(push)  # connected (with CURVE: admitted)
        start = time.monotonic()

        @FUZZ
        @given(batch=st.lists(messages, min_size=1, max_size=8))
        def fuzz(batch: list[list[bytes]]) -> None:
            before = target.loop.dropped
            for parts in batch:
                push.send_multipart(parts)
            target.settle(push)
            assert target.loop.dropped - before == sum(map(coordinator_drops, batch)), "one drop per message"
            target.assert_alive()

        fuzz()
        elapsed = time.monotonic() - start
        if auth == "curve":
            dropped, since = target.loop.dropped, time.monotonic()
            outsiders = [connect(ctx, zmq.PUSH, opts, target.collect) for opts in OUTSIDERS.values()]
            for outsider in outsiders:
                for junk in (b"\xc1", encode(EngineStats(rank=2, waiting=9, running=9))):
                    outsider.send(junk, flags=zmq.NOBLOCK)
            time.sleep(1.0)  # what could arrive has arrived: a refused peer retries every 100 ms
            target.settle(push)
            assert target.loop.dropped == dropped and target.loop.describe()["counts"][2] != [9, 9], "refused"
            assert_stranger_refused_and_logged_once_a_second(caplog, time.monotonic() - since)
        target.assert_publishes(ctx, auth, push)
        target.assert_alive()
    lines = drop_lines(caplog, "coordinator")
    assert lines and all(": dropped a malformed message from collect peer 127.0.0.1: " in line for line in lines)
    assert len(lines) <= rate_bound(1, elapsed), f"{len(lines)} lines for one sender in {elapsed:.1f}s"


def test_a_multipart_message_on_collect_is_dropped_once_naming_its_sender(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    with coordinator("plain") as target, zmq_context() as ctx:
        push = connect(ctx, zmq.PUSH, member_opts("plain"), target.collect)
        # The second frame alone would be a valid message: it must not be acted on either.
        push.send_multipart([b"\xc1", encode(EngineStats(rank=3, waiting=5, running=5)), b"tail"])
        target.settle(push)
        assert target.loop.dropped == 1
        assert target.loop.describe()["counts"][3] == [0, 0]
    lines = drop_lines(caplog, "coordinator")
    assert lines == ["coordinator: dropped a malformed message from collect peer 127.0.0.1: "
                     "a message of 3 frames (want 1)"]


waves = st.sampled_from([-(2**63), -1, 0, 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1]) | INT64
ranks = st.integers(-2, 5) | INT64
# Rank counts stay small or just past the bound: a huge one would take the old code's memory with it.
rank_counts = st.integers(-2, 8) | st.sampled_from([1 << 16, (1 << 16) + 1])
extreme_messages = st.one_of(
    st.builds(WaveComplete, ranks, waves), st.builds(StartWave, ranks, waves), st.builds(FirstRequest, ranks, waves),
    st.builds(HoldAck, ranks, INT64, waves, st.booleans()), st.builds(EngineStats, ranks, INT64, INT64),
    st.builds(ScaleEngines, rank_counts, rank_counts), st.builds(EngineDead, ranks, st.text(max_size=8)),
    st.builds(HoldCluster, INT64, rank_counts), st.builds(ReleaseCluster, INT64),
)


def test_coordinator_survives_valid_messages_with_extreme_values() -> None:
    """A wave past an int64 once made the next snapshot unencodable, which ended the loop."""
    with coordinator("plain") as target, zmq_context() as ctx:
        push = connect(ctx, zmq.PUSH, member_opts("plain"), target.collect)

        @FUZZ
        @given(batch=st.lists(extreme_messages, min_size=1, max_size=6))
        def fuzz(batch: list[msgspec.Struct]) -> None:
            before = target.loop.dropped
            bodies = [encode(m) for m in batch]
            for body in bodies:
                push.send(body)
            push.send(encode(ScaleEngines(4, 4)))  # rank 0 exists for the marker
            target.settle(push)
            target.assert_alive()
            assert target.loop.dropped - before == sum(not decodes(coordinator_decoder, b) for b in bodies)

        fuzz()
        target.assert_publishes(ctx, "plain", push)


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
    sockets = EngineSockets(ctx, [inputs], connect(ctx, zmq.PUSH, inproc, "inproc://fuzz-collect"),
                            connect(ctx, zmq.SUB, inproc, "inproc://fuzz-broadcast"), "inproc://fuzz-wake", rank=0)
    loop = EngineLoop(EchoEngine(EngineContext(0, 0, 1, 1, "n")), 0, sockets, stats_interval_s=0.01)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            loop.run()
        except BaseException as exc:
            errors.append(exc)
        finally:
            sockets.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert broadcast.poll(5000), "the engine subscribes to the broadcast socket"
    broadcast.recv()
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


@pytest.mark.parametrize("auth", AUTH)
def test_engine_input_survives_fuzz_from_any_identity(auth: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    senders = itertools.count()
    used: set[str] = set()
    with engine(auth) as target, zmq_context() as ctx:
        start = time.monotonic()

        @FUZZ
        @given(identity=st.binary(min_size=0, max_size=24), batch=st.lists(engine_inputs, min_size=1, max_size=8))
        def fuzz(identity: bytes, batch: list[list[bytes]]) -> None:
            # A new peer each time (a ROUTER ignores a second peer with a live peer's identity).
            identity = next(senders).to_bytes(3, "big") + identity
            used.add(identity.hex())
            dealer = connect(ctx, zmq.DEALER, member_opts(auth), target.address, identity=identity)
            try:
                before = target.loop._drops.dropped
                accepted: list[str] = []
                for parts in batch:
                    dealer.send_multipart(parts)
                    if not engine_drops(parts):
                        msg = decode_input(*parts)
                        accepted += [r.request_id for r in getattr(msg, "requests", [msg]) if isinstance(r, Request)]
                target.settle(dealer)
                assert target.loop._drops.dropped - before == sum(map(engine_drops, batch)), "one drop per message"
                dealer.send_multipart([RequestType.ABORT.value, encode(Abort(accepted))])  # no endless echo
                target.settle(dealer)
                target.assert_alive()
            finally:
                dealer.close(linger=0)

        fuzz()
        elapsed = time.monotonic() - start
        if auth == "curve":
            added = target.settle(connect(ctx, zmq.DEALER, member_opts(auth), target.address, b"c-member"))["added"]
            since = time.monotonic()
            outsiders = [connect(ctx, zmq.DEALER, opts, target.address, identity=b"c-outsider-" + name[:1].encode())
                         for name, opts in OUTSIDERS.items()]
            for outsider in outsiders:
                outsider.send_multipart([RequestType.ADD.value, encode(Request("outsider", [1], 1))],
                                        flags=zmq.NOBLOCK)
            time.sleep(1.0)  # what could arrive has arrived
            assert not any(o.poll(0) for o in outsiders), "an outsider got an answer"
            member = connect(ctx, zmq.DEALER, member_opts(auth), target.address, b"c-member-2")
            assert target.settle(member)["added"] == added, "an outsider's request was run"
            assert_stranger_refused_and_logged_once_a_second(caplog, time.monotonic() - since)
        target.assert_answers(ctx, auth)
        target.assert_alive()
    lines = drop_lines(caplog, "rank 0")
    pattern = re.compile(r"rank 0: dropped a malformed message from client ([0-9a-f]+)(\.\.\.)?: .+")
    assert lines and all((m := pattern.fullmatch(line)) and any(u.startswith(m[1]) for u in used) for line in lines)
    assert len(lines) <= rate_bound(len(used), elapsed)


def test_huge_frames_cost_their_sender_the_connection_or_one_short_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    with engine("plain") as eng, coordinator("plain") as coord, zmq_context() as ctx:
        over = b"\xc1" * (MAX_BYTES + 1)  # libzmq cuts the connection rather than allocate it
        huge_dealer = connect(ctx, zmq.DEALER, member_opts("plain"), eng.address, b"c-huge")
        huge_dealer.send_multipart([RequestType.ADD.value, over])
        huge_push = connect(ctx, zmq.PUSH, member_opts("plain"), coord.collect)
        huge_push.send(over)
        under = b"\xee" * (MAX_BYTES - 64)  # within the limit: decoded (the tag as well), dropped, logged briefly
        dealer = connect(ctx, zmq.DEALER, member_opts("plain"), eng.address, b"c-big")
        dealer.send_multipart([under, b"body"])
        eng.settle(dealer)
        push = connect(ctx, zmq.PUSH, member_opts("plain"), coord.collect)
        push.send(under)
        coord.settle(push)
        assert eng.loop._drops.dropped == 1 and coord.loop.dropped == 1, "only the frames under the limit arrive"
        eng.assert_answers(ctx, "plain")
        coord.assert_publishes(ctx, "plain", push)
    lines = drop_lines(caplog, "rank 0") + drop_lines(caplog, "coordinator")
    assert len(lines) == 2 and all(len(line) < 1000 for line in lines), [line[:200] for line in lines]
    assert "client 632d626967" in lines[0] and "(1048512 bytes)" in lines[0]


# ---- the handshake ROUTER -----------------------------------------------------------------

HASH = "cafe"


def init_for(rank: int) -> Init:
    return Init(EngineAddresses("ipc://collect", "ipc://broadcast"), ParallelConfig(1, 1, False, 32))


def handshake_drops(identity: bytes, parts: list[bytes]) -> bool:
    """Whether the server drops it; the rest are handshake messages it rejects (not fuzz: see test_handshake)."""
    return len(parts) != 1 or len(identity) != 2 or not decodes(handshake_decoder, parts[0])




@pytest.mark.parametrize("auth", AUTH)
def test_handshake_drops_fuzz_and_a_real_engine_still_becomes_ready(
    auth: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    with zmq_context() as ctx:
        gate = guard(ctx, KEYS if auth == "curve" else None)
        server = HandshakeServer(ctx, server_opts(auth), transport="tcp", ipc_dir=None, ip="127.0.0.1")
        address = server.addresses[0]
        outcome: list[Any] = []

        def serve() -> None:
            try:
                outcome.append(server.run({0: False}, init_for, HASH, timeout_s=80))
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        fake_ranks = (r for r in itertools.count(1) if r % 256)  # unknown ranks, each a new peer
        peers = itertools.count()
        sent = 0
        start = time.monotonic()

        @FUZZ
        @given(rank_like=st.booleans(), tail=st.binary(max_size=40), batch=st.lists(messages, min_size=1, max_size=6))
        def fuzz(rank_like: bool, tail: bytes, batch: list[list[bytes]]) -> None:
            nonlocal sent
            # Each example a new peer: a 2-byte identity naming no expected rank, or any other identity.
            identity = rank_identity(next(fake_ranks)) if rank_like else next(peers).to_bytes(3, "big") + tail
            dealer = connect(ctx, zmq.DEALER, member_opts(auth), address, identity=identity)
            try:
                for parts in batch:
                    if handshake_drops(identity, parts):
                        dealer.send_multipart(parts)
                        sent += 1
                wait_until(lambda: server.drops.dropped == sent or not thread.is_alive())
                assert thread.is_alive(), outcome
                assert server.drops.dropped == sent, "one drop per message"
            finally:
                dealer.close(linger=0)

        fuzz()
        elapsed = time.monotonic() - start
        if auth == "curve":  # a forged HELLO would end the startup; an outsider's never arrives
            since = time.monotonic()
            forgers = [connect(ctx, zmq.DEALER, o, address, identity=rank_identity(7)) for o in OUTSIDERS.values()]
            for forger in forgers:
                forger.send(encode(Hello(local=False)), flags=zmq.NOBLOCK)
            time.sleep(1.0)
            assert thread.is_alive() and server.drops.dropped == sent, outcome
            assert_stranger_refused_and_logged_once_a_second(caplog, time.monotonic() - since)
        engine_handshake(ctx, member_opts(auth), address, 0, local=False, timeout_s=20,
                         make_ready=lambda _: Ready(3, HASH, ["ipc://in0"]))
        thread.join(timeout=20)
        server.close()
        if gate is not None:
            gate.stop()
    assert len(outcome) == 1 and not isinstance(outcome[0], BaseException), outcome
    assert outcome[0].capacity == 3 and set(outcome[0].ready) == {0}
    lines = drop_lines(caplog, "handshake")
    assert lines and all(re.fullmatch(r"handshake: dropped a malformed message from peer [0-9a-f]+(\.\.\.)?: .+", line)
                         for line in lines)
    assert len(lines) <= rate_bound(sent, elapsed)


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
            assert self.client._thread.is_alive(), "the client's IO thread died"
            self.pub.send(marker)
            snap = self.client.snapshot()
            return wait_until(lambda: (s := self.client.snapshot()) is not None and s.seq == mark, 0.1) or (
                snap is not None and snap.seq == mark)

        assert wait_until(seen, timeout=15), "a valid snapshot no longer reaches the client"

    def dropped(self) -> int:
        return self.client._drops.dropped


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
            "fuzz", [EngineEndpoint(0, "n", [address[engine]])],
            CoordinatorEndpoints("n", [address[pub]], [address[collect]], [address[collect]]), lockstep=False,
            curve=KEYS if auth == "curve" else None,
        )
        client = Client(endpoints, node_id="n", follow_liveness=False)
        try:
            yield StatsTarget(client, pub)
        finally:
            client.close()
            if gate is not None:
                gate.stop()


@pytest.mark.parametrize("auth", AUTH)
def test_client_stats_survive_fuzz(auth: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    with stats_target(auth) as target:
        target.settle()
        start = time.monotonic()

        @FUZZ
        @given(batch=st.lists(messages, min_size=1, max_size=8))
        def fuzz(batch: list[list[bytes]]) -> None:
            before = target.dropped()
            for parts in batch:
                target.pub.send_multipart(parts)
            target.settle()
            assert target.dropped() - before == sum(map(client_drops, batch)), "one drop per message"
            assert target.client._thread.is_alive()

        fuzz()
        elapsed = time.monotonic() - start
        address = target.pub.getsockopt_string(zmq.LAST_ENDPOINT)
    lines = drop_lines(caplog, "client")
    assert lines and all(f": dropped a malformed message from coordinator publish {address}: " in line
                         for line in lines)
    assert len(lines) <= rate_bound(1, elapsed)


@pytest.mark.parametrize("impostor", ["a plain PUB", "a PUB with another cluster's keys"])
def test_a_curve_client_hears_nothing_from_an_impostor_publisher(impostor: str) -> None:
    opts = SocketOptions() if impostor == "a plain PUB" else SocketOptions(curve=STRANGER)
    with stats_target("curve", pub_opts=opts) as target:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            target.pub.send(encode(StatsSnapshot([(0, 0)], 0, False, seq=1)))
            target.pub.send_multipart([b"\xc1", b"garbage"])
            time.sleep(0.05)
        assert target.client.snapshot() is None and target.dropped() == 0, "the impostor was heard"


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
            client = Client(ClusterEndpoints(
                "flood", [EngineEndpoint(0, "n", [stub[engine_stub]])],
                CoordinatorEndpoints("n", [publish], [stub[collect]], [stub[collect]]), lockstep=False,
            ), node_id="n", follow_liveness=False)
            stack.callback(client.close)
            conn.send(publish)
            alive = client._thread.is_alive
            drops = lambda: client._drops.dropped  # noqa: E731
        while conn.recv() != "stop":
            gc.collect()
            conn.send({"rss": psutil.Process().memory_info().rss, "drops": drops(), "records": counter.count,
                       "alive": alive(), "heard": kind != "client" or client.snapshot() is not None})


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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["coordinator", "engine", "client"])
def test_a_flood_of_garbage_keeps_memory_bounded_and_the_log_short(kind: str) -> None:
    spawn = multiprocessing.get_context("spawn")
    ours, theirs = spawn.Pipe()
    with zmq_context() as ctx:
        pub = make_socket(ctx, zmq.PUB, SocketOptions())
        publish = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
        proc = spawn.Process(target=serve_component, args=(kind, publish, theirs), daemon=True)
        proc.start()
        theirs.close()  # so that a dead child reads as EOF here, not as silence
        try:
            assert ours.poll(60), "the component did not start"
            address = ours.recv()
            if kind == "client":
                senders = [pub]
                heard = measure(ours, lambda s: s["heard"] or bool(pub.send(encode(StatsSnapshot([], 0, False)))))
                assert heard["heard"], "the client never heard the publisher"
            else:
                sock_kind = zmq.DEALER if kind == "engine" else zmq.PUSH
                senders = [connect(ctx, sock_kind, SocketOptions(), address, identity=b"f%03d" % i)
                           for i in range(50)]
            flood = Flood(kind, senders)
            flood.send(2_000)  # warm up: allocator, sender tables, caches
            warm = measure(ours, lambda s: s["drops"] >= 2_000)
            assert warm["drops"] >= 2_000, warm
            start = time.monotonic()
            flood.send(20_000)
            after = measure(ours, lambda s: s["drops"] >= 22_000)
            elapsed = time.monotonic() - start
        finally:
            with contextlib.suppress(OSError):
                ours.send("stop")
            proc.join(timeout=15)
            if proc.is_alive():
                proc.kill()
    assert after["alive"] and after["drops"] >= 22_000, after
    assert after["rss"] - warm["rss"] < RSS_SLACK, (after["rss"], warm["rss"])
    lines = after["records"] - warm["records"]
    assert lines <= rate_bound(len(senders), elapsed), f"{lines} log lines for 20,000 dropped messages"


# ---- HTTP ------------------------------------------------------------------------------------

MAX_BODY = 4096


@contextlib.contextmanager
def http_server() -> Iterator[tuple[str, int]]:
    """The real app over a real client and a real engine loop, served on a loopback socket."""
    with engine("plain") as eng, zmq_context() as ctx:
        publish = make_socket(ctx, zmq.PUB, SocketOptions())
        collect = make_socket(ctx, zmq.PULL, SocketOptions())
        stub = {s: f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}" for s in (publish, collect)}
        client = Client(ClusterEndpoints(
            "fuzz", [EngineEndpoint(0, "n", [eng.address])],
            CoordinatorEndpoints("n", [stub[publish]], [stub[collect]], [stub[collect]]), lockstep=False,
        ), node_id="n", follow_liveness=False)
        app = build_app(client, model="fuzz", max_body_bytes=MAX_BODY, max_tokens_limit=32, vocab_size=256)
        listener = socket.create_server(("127.0.0.1", 0))
        address = listener.getsockname()
        stop = threading.Event()
        server = threading.Thread(target=serve_on_socket, args=(listener, app), daemon=True, kwargs={
            "idle_timeout_s": 1.0, "read_timeout_s": 1.0, "graceful_shutdown_s": 0.5, "stop": stop})
        server.start()
        try:
            assert wait_until(lambda: _health(address) is not None, timeout=15), "the server did not start"
            yield address
        finally:
            stop.set()
            server.join(timeout=10)
            client.close()


def _health(address: tuple[str, int]) -> dict[str, Any] | None:
    try:
        conn = http.client.HTTPConnection(*address, timeout=5)
        conn.request("GET", "/health")
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
    except OSError:
        return None
    return json.loads(body) if resp.status == 200 else None


def exchange(address: tuple[str, int], raw: bytes, half_close: bool = False) -> bytes:
    """Send ``raw`` on a new connection; everything the server sends until it closes."""
    data = b""
    with socket.create_connection(address, timeout=10) as sock:
        try:
            sock.sendall(raw)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass  # a clean close, as far as the client can tell: the server refused the rest unread
    return data


def check_answer(data: bytes) -> int | None:
    """The answer's status (None: the server closed without one); a 4xx must be OpenAI's JSON error shape."""
    while re.match(rb"HTTP/1\.1 1\d\d ", data):  # interim answers (Expect: 100-continue)
        data = data.partition(b"\r\n\r\n")[2]
    if not data:
        return None
    head, sep, body = data.partition(b"\r\n\r\n")
    assert sep, data[:300]
    status_line, *header_lines = head.split(b"\r\n")
    m = re.fullmatch(rb"HTTP/1\.1 (\d{3}) [ -~]*", status_line)
    assert m, status_line
    status = int(m[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(b":") for h in header_lines)}
    assert 200 <= status < 500, (status, body[:300])
    if status >= 400:
        assert headers.get(b"content-type") == b"application/json", (status, headers, body[:200])
        assert len(body) == int(headers[b"content-length"]), (status, body[:200])
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error", error
    return status


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
FIELDS = ("prompt", "max_tokens", "stream", "model", "prompt_token_ids", "rank", "echo", "n")
json_bodies = st.one_of(
    json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({}, optional={f: json_values | st.integers(-5, 40) for f in FIELDS}).map(
        lambda d: json.dumps(d).encode()),
    json_values.map(lambda v: json.dumps(v).encode()).flatmap(lambda b: st.integers(0, len(b)).map(lambda n: b[:n])),
    st.binary(max_size=200),
)
TOKEN = string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~"
FRAMING = {b"content-length", b"transfer-encoding", b"connection"}  # set by the test, so the server always answers


@st.composite
def http_requests(draw: st.DrawFn) -> bytes:
    """A request line, headers and a body, each of them right or wrong; framed by Content-Length, then closed."""
    if draw(st.booleans()):
        method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]))
        target = draw(st.sampled_from(["/v1/completions", "/v1/generate", "/health", "/v1/models", "/metrics",
                                       "/", "*", "/v1/completions?x=1", "/%ff", "//v1//generate"]))
        version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2", "HTTP/1.1 x", "", "http/1.1"]))
        line = f"{method} {target} {version}".encode()
    else:
        line = draw(st.text(TOKEN + " /\t", max_size=40).map(str.encode) | st.binary(max_size=40))
    names = st.sampled_from([b"Content-Type", b"Accept", b"X-Fuzz", b"Expect", b"Host", b"Authorization"]) | st.binary(
        min_size=0, max_size=12)
    headers = [(n, v) for n, v in draw(st.lists(st.tuples(names, st.binary(max_size=40)), max_size=4))
               if n.strip().lower() not in FRAMING]
    body = draw(json_bodies)
    head = line + b"\r\nHost: fuzz\r\n" + b"".join(n + b": " + v + b"\r\n" for n, v in headers)
    return head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body


FRAMING_ATTACKS = [
    b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
    b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n{}",
    b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}x",
    b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n{}",
    b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n"
    b"2\r\n{}\r\n0\r\n\r\n",
    b"GET /health\r\n\r\n",
    b"\r\n\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(64)),  # a TLS hello on the plain port
    b"GET /health HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 20_000 + b"\r\n\r\n",  # a head past 16 KiB
    b"GET /health HTTP/1.1\r\n Folded: header\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header: x\r\n\r\n",
]


def test_http_fuzz_gets_openai_errors_or_a_clean_close(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    statuses: list[int | None] = []
    with http_server() as address:
        start = time.monotonic()

        @settings(FUZZ, max_examples=60)
        @given(raw=http_requests() | st.sampled_from(FRAMING_ATTACKS))
        def fuzz(raw: bytes) -> None:
            statuses.append(check_answer(exchange(address, raw)))

        fuzz()
        for raw in FRAMING_ATTACKS:  # each at least once, whatever the draw
            statuses.append(check_answer(exchange(address, raw)))
        elapsed = time.monotonic() - start
        # A body shorter than its Content-Length, then a half-close: no answer can come, the server just closes.
        cut = b'POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"prompt_token_ids": [1'
        assert check_answer(exchange(address, cut, half_close=True)) in (None, 400)
        assert _health(address) == {"status": "ok", "client_index": 0, "client_count": 1}
        conn = http.client.HTTPConnection(*address, timeout=10)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": [7, 8], "max_tokens": 3}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["choices"][0]["token_ids"] == [7, 8, 7]
        conn.close()
    assert 400 in statuses, "the fuzz never reached a refusal"
    assert not [r for r in caplog.records if r.getMessage() == "Invalid HTTP request received."], "uvicorn's line"
    lines = drop_lines(caplog, "api server")
    assert lines and all(": dropped a malformed HTTP request from HTTP client 127.0.0.1: " in line for line in lines)
    assert len(lines) <= rate_bound(1, elapsed)

