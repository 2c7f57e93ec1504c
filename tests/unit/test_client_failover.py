"""A retryable request moved off a dead rank takes its answer only from the rank it moved to."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from raydp.client.client import Client
from raydp.errors import DeathCause, EngineDeadError
from raydp.wire.codec import encode
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint
from raydp.wire.protocol import Output, OutputBatch, Request, RequestType, request_decoder

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def rig() -> Iterator[tuple[Client, list[zmq.Socket[bytes]]]]:
    """Two engine ROUTERs the test drives, and a coordinator nobody runs."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    engines = [ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)]
    collect, publish = ctx.socket(zmq.PULL), ctx.socket(zmq.PUB)
    addr = {s: f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}" for s in (*engines, collect, publish)}
    endpoints = ClusterEndpoints(
        "failover",
        [EngineEndpoint(r, "n", [addr[e]]) for r, e in enumerate(engines)],
        CoordinatorEndpoints("n", [addr[publish]], [addr[collect]], [addr[collect]]),
        lockstep=False,
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
    late = Output(request.request_id, [5], seq=request.seq)
    engines[first].send_multipart([old_identity, encode(OutputBatch(first, [late]))])
    answer = Output(request.request_id, [5, 5], True, "length", seq=moved.seq)
    engines[other].send_multipart([identity, encode(OutputBatch(other, [answer]))])
    assert handle.result(timeout=10) == [5, 5]


def test_a_late_output_of_an_aborted_submission_does_not_join_its_id_reused(rig) -> None:  # type: ignore[no-untyped-def]
    client, engines = rig
    first = client.submit([8], max_tokens=100, rank=0, request_id="long")
    identity, aborted = receive(engines[0])
    client.abort("long")
    assert first.result(timeout=10) == [] and first.finish_reason == "abort"
    again = client.submit([9], max_tokens=1, rank=0, request_id="long")
    assert engines[0].poll(5000)
    engines[0].recv_multipart()  # the abort
    _, resubmitted = receive(engines[0])
    assert resubmitted.request_id == "long" and resubmitted.seq != aborted.seq
    # The engine stepped the first submission once more before it read the abort.
    late = Output("long", [8], seq=aborted.seq)
    answer = Output("long", [9], True, "length", seq=resubmitted.seq)
    engines[0].send_multipart([identity, encode(OutputBatch(0, [late]))])
    engines[0].send_multipart([identity, encode(OutputBatch(0, [answer]))])
    assert again.result(timeout=10) == [9]


def test_with_no_snapshot_yet_every_rank_counts_as_live(rig) -> None:  # type: ignore[no-untyped-def]
    client, _ = rig
    assert client.snapshot() is None and client.live_ranks() == [0, 1]
