"""The client's side of waves, against real sockets standing in for the engine and coordinator."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from raydp.client.client import Client
from raydp.errors import ConfigError
from raydp.wire.control import FirstRequest, coordinator_decoder
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint
from raydp.wire.transport import SocketOptions

pytestmark = pytest.mark.timeout(30)
LIMIT = 1 << 16


@pytest.fixture
def paused_cluster() -> Iterator[tuple[Client, zmq.Socket[bytes], zmq.Socket[bytes]]]:
    """A lockstep cluster that is paused (no snapshot says running): an engine ROUTER and a coordinator PULL."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    engine, collect, publish = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL), ctx.socket(zmq.PUB)
    addr = {s: f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}" for s in (engine, collect, publish)}
    endpoints = ClusterEndpoints(
        "waves",
        [EngineEndpoint(0, "n", [addr[engine]])],
        CoordinatorEndpoints("n", [addr[publish]], [addr[collect]], [addr[collect]]),
        lockstep=True,
    )
    client = Client(endpoints, node_id="n", options=SocketOptions(max_message_bytes=LIMIT))
    yield client, engine, collect
    client.close()
    ctx.destroy(linger=0)


def test_an_oversized_request_is_refused_without_waking_the_cluster(paused_cluster) -> None:  # type: ignore[no-untyped-def]
    client, engine, collect = paused_cluster
    with pytest.raises(ConfigError, match="max_message_bytes"):
        client.submit([2**31 - 1] * LIMIT, max_tokens=1).result(timeout=10)
    assert not collect.poll(500), "a refused request must not start a wave"
    client.submit([1], max_tokens=1)
    assert collect.poll(5000), "the first real request of a paused cluster tells the coordinator"
    assert coordinator_decoder(collect.recv()) == FirstRequest(rank=0, wave=0)
    assert engine.poll(5000), "and then reaches the engine"
