"""The startup handshake over real ZMQ sockets: the happy path and every rejection."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from raydp.errors import HandshakeError, StartupError
from raydp.wire.codec import encode
from raydp.wire.handshake import HandshakeServer, engine_handshake
from raydp.wire.protocol import (
    EngineAddresses,
    Hello,
    Init,
    ParallelConfig,
    Ready,
    Reject,
    handshake_decoder,
    rank_identity,
)
from raydp.wire.transport import IpcDir, SocketOptions

OPTS = SocketOptions()
HASH = "cafe"


def init_for(rank: int) -> Init:
    return Init(EngineAddresses("ipc://collect", "ipc://broadcast"), ParallelConfig(2, 1, False, 32))


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    c: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def server(ctx: zmq.Context[zmq.Socket[bytes]]) -> Iterator[HandshakeServer]:
    ipc = IpcDir("test-handshake")
    s = HandshakeServer(ctx, OPTS, transport="ipc", ipc_dir=ipc)
    yield s
    s.close()
    ipc.remove()


def engine(
    ctx: zmq.Context[zmq.Socket[bytes]],
    address: str,
    rank: int,
    capacity: int = 10,
    config_hash: str = HASH,
    local: bool = True,
) -> threading.Thread:
    def target() -> None:
        try:
            engine_handshake(
                ctx,
                OPTS,
                address,
                rank,
                local=local,
                timeout_s=5,
                make_ready=lambda _: Ready(capacity, config_hash, [f"ipc://in{rank}"]),
            )
        except Exception:
            pass  # the server's error is what these tests check

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t


def raw_dealer(ctx: zmq.Context[zmq.Socket[bytes]], address: str, identity: bytes) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


@pytest.mark.timeout(20)
def test_two_engines_become_ready_and_capacities_are_summed(ctx, server) -> None:  # type: ignore[no-untyped-def]
    seen: list[tuple[int, int]] = []
    for rank, cap in ((0, 7), (1, 5)):
        engine(ctx, server.addresses[0], rank, cap)
    result = server.run(
        {0: True, 1: True}, init_for, HASH, timeout_s=10, progress=lambda done, total: seen.append((done, total))
    )
    assert result.capacity == 12
    assert result.ready[1].input_addresses == ["ipc://in1"]
    assert seen == [(1, 2), (2, 2)]


@pytest.mark.timeout(20)
def test_forged_rank_identity_is_rejected_naming_the_rank(ctx, server) -> None:  # type: ignore[no-untyped-def]
    forger = raw_dealer(ctx, server.addresses[0], rank_identity(7))
    forger.send(encode(Hello(local=True)))
    with pytest.raises(HandshakeError, match="unknown rank 7") as info:
        server.run({0: True}, init_for, HASH, timeout_s=5)
    assert info.value.rank == 7
    assert forger.poll(2000), "the forger is told why instead of hanging"
    assert isinstance(handshake_decoder(forger.recv()), Reject)


@pytest.mark.timeout(20)
def test_duplicate_hello_is_rejected(ctx, server) -> None:  # type: ignore[no-untyped-def]
    first = raw_dealer(ctx, server.addresses[0], rank_identity(0))
    first.send(encode(Hello(local=True)))
    first.send(encode(Hello(local=True)))
    with pytest.raises(HandshakeError, match="duplicate rank 0"):
        server.run({0: True, 1: True}, init_for, HASH, timeout_s=5)


@pytest.mark.timeout(20)
def test_ready_before_hello_is_rejected(ctx, server) -> None:  # type: ignore[no-untyped-def]
    eager = raw_dealer(ctx, server.addresses[0], rank_identity(1))
    eager.send(encode(Ready(1, HASH, [])))
    with pytest.raises(HandshakeError, match="rank 1 sent READY before HELLO"):
        server.run({0: True, 1: True}, init_for, HASH, timeout_s=5)


@pytest.mark.timeout(20)
def test_config_hash_mismatch_is_rejected(ctx, server) -> None:  # type: ignore[no-untyped-def]
    engine(ctx, server.addresses[0], 0, config_hash="beef")
    with pytest.raises(HandshakeError, match="rank 0 config hash 'beef'"):
        server.run({0: True}, init_for, HASH, timeout_s=5)


@pytest.mark.timeout(20)
def test_local_remote_mismatch_is_rejected(ctx, server) -> None:  # type: ignore[no-untyped-def]
    engine(ctx, server.addresses[0], 0, local=False)
    with pytest.raises(HandshakeError, match="rank 0 says it is remote but was placed local"):
        server.run({0: True}, init_for, HASH, timeout_s=5)


@pytest.mark.timeout(20)
def test_garbage_is_dropped_and_startup_still_completes(ctx, server) -> None:  # type: ignore[no-untyped-def]
    noise = raw_dealer(ctx, server.addresses[0], rank_identity(0))
    noise.send(b"\xc1not msgpack")
    noise.send_multipart([b"a", b"b"])
    engine(ctx, server.addresses[0], 1)
    result = server.run({1: True}, init_for, HASH, timeout_s=5)
    assert set(result.ready) == {1}


@pytest.mark.timeout(20)
def test_silent_engine_times_out_naming_the_missing_rank(ctx, server) -> None:  # type: ignore[no-untyped-def]
    engine(ctx, server.addresses[0], 0)
    with pytest.raises(StartupError, match=r"no HELLO from ranks \[1\]"):
        server.run({0: True, 1: True}, init_for, HASH, timeout_s=1)


@pytest.mark.timeout(20)
def test_liveness_failure_stops_the_wait_at_once(ctx, server) -> None:  # type: ignore[no-untyped-def]
    def liveness() -> None:
        raise StartupError("engine rank 0 died: process died")

    start = time.monotonic()
    with pytest.raises(StartupError, match="rank 0 died"):
        server.run({0: True}, init_for, HASH, timeout_s=30, liveness=liveness)
    assert time.monotonic() - start < 10, "a death ends the wait, not the 30 s timeout"


@pytest.mark.timeout(20)
def test_engine_side_reports_a_rejection(ctx, server) -> None:  # type: ignore[no-untyped-def]
    errors: list[BaseException] = []

    def run_server() -> None:
        try:
            server.run({0: True}, init_for, HASH, timeout_s=5)
        except HandshakeError as exc:
            errors.append(exc)

    t = threading.Thread(target=run_server, daemon=True)
    t.start()
    with pytest.raises(HandshakeError, match="front-end rejected rank 3: unknown rank 3"):
        engine_handshake(
            ctx, OPTS, server.addresses[0], 3, local=True, timeout_s=5, make_ready=lambda _: Ready(0, HASH, [])
        )
    t.join(5)
    assert errors and "unknown rank 3" in str(errors[0])
