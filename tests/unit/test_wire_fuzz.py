"""Wire fuzzing: generated, truncated and misshapen frames on every socket a peer can reach.

Real ZMQ sockets and real loops, no Ray and no mocks (``wire_targets``): the
handshake ROUTER (``HandshakeServer.run``), an engine's input ROUTER (the
real ``EngineLoop`` with ``EchoEngine``), the coordinator's collect PULL (the
real ``CoordinatorLoop``) and a client's stats SUB (a real ``Client`` under a
PUB the test binds); HTTP is in ``test_http_fuzz``. Each target is fuzzed
without auth and with CURVE: an outsider is refused before anything is
decoded, a member's garbage is dropped.

After each fuzz the target still gives the right answer; each dropped message
counts once, never once per frame; its log line names the sender; and a flood
is rate limited (``raydp.wire.dropped``). The floods run the coordinator, an
engine and a client in spawned processes, so their RSS is measured alone.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from raydp.wire.codec import encode
from raydp.wire.control import (
    EngineDead,
    EngineStats,
    FirstRequest,
    HoldAck,
    HoldCluster,
    ReleaseCluster,
    ScaleEngines,
    StartWave,
    StatsSnapshot,
    WaveComplete,
    coordinator_decoder,
)
from raydp.wire.dropped import MAX_REASON_CHARS, DropLog
from raydp.wire.handshake import HandshakeServer, engine_handshake
from raydp.wire.protocol import (
    Abort,
    EngineAddresses,
    Hello,
    Init,
    ParallelConfig,
    Ready,
    Request,
    RequestType,
    decode_input,
    handshake_decoder,
    rank_identity,
)
from raydp.wire.security import guard
from raydp.wire.transport import SocketOptions, make_socket
from tests.unit.wire_targets import (
    AUTH,
    FUZZ,
    INT64,
    KEYS,
    MAX_BYTES,
    OUTSIDERS,
    RSS_SLACK,
    STRANGER,
    Flood,
    assert_stranger_refused_and_logged_once_a_second,
    client_drops,
    connect,
    coordinator,
    coordinator_drops,
    decodes,
    drop_lines,
    engine,
    engine_drops,
    engine_inputs,
    measure,
    member_opts,
    messages,
    offer,
    rate_bound,
    serve_component,
    server_opts,
    stats_target,
    wait_until,
    zmq_context,
)

pytestmark = pytest.mark.timeout(90)


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
                    offer(outsider, junk)
            time.sleep(1.0)  # what could arrive has arrived: a refused peer retries every 100 ms
            target.settle(push)
            assert target.loop.dropped == dropped and target.loop.describe().counts[2] != [9, 9], "refused"
            assert_stranger_refused_and_logged_once_a_second(caplog, since)
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
        assert target.loop.describe().counts[3] == [0, 0]
    lines = drop_lines(caplog, "coordinator")
    assert lines == [
        "coordinator: dropped a malformed message from collect peer 127.0.0.1: a message of 3 frames (want 1)"
    ]


waves = st.sampled_from([-(2**63), -1, 0, 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1]) | INT64
ranks = st.integers(-2, 5) | INT64
# Rank counts stay small or just past the bound: a huge one would take the old code's memory with it.
rank_counts = st.integers(-2, 8) | st.sampled_from([1 << 16, (1 << 16) + 1])
extreme_messages = st.one_of(
    st.builds(WaveComplete, ranks, waves),
    st.builds(StartWave, ranks, waves),
    st.builds(FirstRequest, ranks, waves),
    st.builds(HoldAck, ranks, INT64, waves, st.booleans()),
    st.builds(EngineStats, ranks, INT64, INT64),
    st.builds(ScaleEngines, rank_counts, rank_counts),
    st.builds(EngineDead, ranks, st.text(max_size=8)),
    st.builds(HoldCluster, INT64, rank_counts),
    st.builds(ReleaseCluster, INT64),
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
            outsiders = [
                connect(ctx, zmq.DEALER, opts, target.address, identity=b"c-outsider-" + name[:1].encode())
                for name, opts in OUTSIDERS.items()
            ]
            for outsider in outsiders:
                offer(outsider, RequestType.ADD.value, encode(Request("outsider", [1], 1)))
            time.sleep(1.0)  # what could arrive has arrived
            assert not any(o.poll(0) for o in outsiders), "an outsider got an answer"
            member = connect(ctx, zmq.DEALER, member_opts(auth), target.address, b"c-member-2")
            assert target.settle(member)["added"] == added, "an outsider's request was run"
            assert_stranger_refused_and_logged_once_a_second(caplog, since)
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
                offer(forger, encode(Hello(local=False)))
            time.sleep(1.0)  # a forged HELLO, were it admitted, has arrived by now (a negative: no event to await)
            assert thread.is_alive() and server.drops.dropped == sent, outcome
            assert_stranger_refused_and_logged_once_a_second(caplog, since)
        engine_handshake(
            ctx,
            member_opts(auth),
            address,
            0,
            local=False,
            timeout_s=20,
            make_ready=lambda _: Ready(3, HASH, ["ipc://in0"]),
        )
        thread.join(timeout=20)
        server.close()
        if gate is not None:
            gate.stop()
    assert len(outcome) == 1 and not isinstance(outcome[0], BaseException), outcome
    assert outcome[0].capacity == 3 and set(outcome[0].ready) == {0}
    lines = drop_lines(caplog, "handshake")
    assert lines and all(
        re.fullmatch(r"handshake: dropped a malformed message from peer [0-9a-f]+(\.\.\.)?: .+", line) for line in lines
    )
    assert len(lines) <= rate_bound(sent, elapsed)


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
            assert target.client._turns.thread.is_alive()

        fuzz()
        elapsed = time.monotonic() - start
        address = target.pub.getsockopt_string(zmq.LAST_ENDPOINT)
    lines = drop_lines(caplog, "client")
    assert lines and all(
        f": dropped a malformed message from coordinator publish {address}: " in line for line in lines
    )
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
                senders = [connect(ctx, sock_kind, SocketOptions(), address, identity=b"f%03d" % i) for i in range(50)]
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
