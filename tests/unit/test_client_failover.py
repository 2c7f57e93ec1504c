"""A retryable request moved off a dead rank takes its answer only from the rank it moved to."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from raydp.client.client import Client
from raydp.errors import DeathCause, EngineDeadError
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint
from raydp.wire.protocol import Output, OutputBatch, Request, RequestType, encode, request_decoder

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def rig() -> Iterator[tuple[Client, list[zmq.Socket[bytes]]]]:
    """Two engine ROUTERs the test drives, and a coordinator nobody runs."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    engines = [ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)]
    collect, publish = ctx.socket(zmq.PULL), ctx.socket(zmq.PUB)
    addr = {s: f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}" for s in (*engines, collect, publish)}
    endpoints = ClusterEndpoints(
        "failover", [EngineEndpoint(r, "n", [addr[e]]) for r, e in enumerate(engines)],
        CoordinatorEndpoints("n", [addr[publish]], [addr[collect]], [addr[collect]]), lockstep=False,
    )
    client = Client(endpoints, node_id="n", follow_liveness=False)
    yield client, engines
    client.close()
    ctx.destroy(linger=0)


def receive(engine: zmq.Socket[bytes]) -> tuple[bytes, Request]:
    assert engine.poll(5000), "the request reaches the engine"
    identity, tag, body = engine.recv_multipart()
    assert tag == RequestType.ADD.value
    return identity, request_decoder(body)


def test_a_late_output_of_the_dead_rank_does_not_join_the_retried_answer(rig) -> None:  # type: ignore[no-untyped-def]
    client, engines = rig
    handle = client.submit([5], max_tokens=2, rank=None, retryable=True)
    first = next(r for r, e in enumerate(engines) if e.poll(5000))
    old_identity, request = receive(engines[first])
    client.mark_dead(EngineDeadError(first, "n", DeathCause.KILLED, "test"))
    other = 1 - first
    identity, moved = receive(engines[other])  # failed over: nothing had streamed yet
    assert moved.request_id == request.request_id
    # The dead rank's output was already on its way: it arrives after the move.
    engines[first].send_multipart([old_identity, encode(OutputBatch(first, [Output(request.request_id, [5])]))])
    engines[other].send_multipart([identity, encode(OutputBatch(other, [Output(request.request_id, [5, 5], True,
                                                                               "length")]))])
    assert handle.result(timeout=10) == [5, 5]
