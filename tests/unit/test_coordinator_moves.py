"""A coordinator that restarted on another node: engines reconnect when told, clients ask an engine."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from raydp.client.client import Client
from raydp.engine.sockets import EngineSockets
from raydp.wire.codec import encode
from raydp.wire.control import BROADCAST_TOPIC, EngineStats, Resync, StatsSnapshot, coordinator_decoder
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint
from raydp.wire.protocol import (
    COORDINATOR_UTILITY,
    OutputBatch,
    RequestType,
    UtilityCall,
    UtilityResult,
    decode_input,
)

pytestmark = pytest.mark.timeout(60)
LOCAL = "tcp://127.0.0.1"


def _coordinator(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> tuple[CoordinatorEndpoints, zmq.Socket[bytes], zmq.Socket[bytes]]:
    """A stand-in coordinator: its PUB (snapshots and broadcasts) and PULL (what engines and clients send)."""
    publish, collect = ctx.socket(zmq.PUB), ctx.socket(zmq.PULL)
    pub = f"{LOCAL}:{publish.bind_to_random_port(LOCAL)}"
    pull = f"{LOCAL}:{collect.bind_to_random_port(LOCAL)}"
    return CoordinatorEndpoints("n", [pub], [pull], [pub]), publish, collect


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def test_a_client_that_hears_nothing_asks_an_engine_and_follows_the_coordinator_there(ctx) -> None:  # type: ignore[no-untyped-def]
    old, _old_pub, _old_pull = _coordinator(ctx)
    new, new_pub, _new_pull = _coordinator(ctx)
    engine = ctx.socket(zmq.ROUTER)
    address = f"{LOCAL}:{engine.bind_to_random_port(LOCAL)}"
    endpoints = ClusterEndpoints(
        "moves", [EngineEndpoint(0, "n", [address])], old, lockstep=False, heartbeat_interval_s=0.2
    )
    client = Client(endpoints, node_id="n", follow_liveness=True)
    try:
        # The old coordinator never publishes: after 1.5 heartbeats the client asks the engine.
        assert engine.poll(10_000), "the client asked an engine where the coordinator is"
        identity, tag, body = engine.recv_multipart()
        call = decode_input(tag, body)
        assert tag == RequestType.UTILITY.value and isinstance(call, UtilityCall)
        assert call.method == COORDINATOR_UTILITY
        answer = UtilityResult(call.call_id, msgspec.to_builtins(new))
        engine.send_multipart([identity, encode(OutputBatch(0, [], answer))])
        # It reconnects its stats SUB to the new coordinator, and takes its snapshots.
        deadline = time.monotonic() + 10
        while client.snapshot() is None and time.monotonic() < deadline:
            new_pub.send(encode(StatsSnapshot([(3, 1)], 0, False, seq=1)))
            time.sleep(0.05)
        snapshot = client.snapshot()
        assert snapshot is not None and snapshot.counts == [(3, 1)]
        assert not client.closed, "a coordinator that moved is not a dead one"
    finally:
        client.close()


def test_engine_sockets_told_of_a_move_send_to_the_new_coordinator_and_hear_its_broadcasts(ctx) -> None:  # type: ignore[no-untyped-def]
    old, _old_pub, old_pull = _coordinator(ctx)
    new, new_pub, new_pull = _coordinator(ctx)
    collect, broadcast = ctx.socket(zmq.PUSH), ctx.socket(zmq.SUB)
    collect.connect(old.collect[0])
    broadcast.connect(old.broadcast[0])
    sockets = EngineSockets(ctx, [], collect, broadcast, rank=0, coordinator_at=(old.collect[0], old.broadcast[0]))
    try:
        assert sockets.coordinator is None and not sockets.apply_move(), "nothing moved yet"
        sockets.follow_coordinator(new, "n")
        assert sockets.apply_move() and sockets.coordinator == new
        sockets.to_coordinator(EngineStats(rank=0, waiting=2, running=1))
        assert new_pull.poll(5000), "load goes to the new coordinator"
        assert coordinator_decoder(new_pull.recv()) == EngineStats(rank=0, waiting=2, running=1)
        assert not old_pull.poll(100), "and no longer to the old one"
        deadline = time.monotonic() + 10
        heard = []
        while not heard and time.monotonic() < deadline:
            new_pub.send_multipart([BROADCAST_TOPIC, encode(Resync())])
            heard = sockets.wait(50)
        assert broadcast in heard, "its broadcasts reach the rank"
    finally:
        sockets.close()
