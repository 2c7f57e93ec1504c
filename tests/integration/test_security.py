"""A host that was not handed the cluster's keys can neither submit work nor listen in."""

from __future__ import annotations

import pytest
import zmq

import raydp
from raydp.wire.codec import encode
from raydp.wire.protocol import Request, RequestType


def _tcp(addresses: list[str]) -> str:
    return next(a for a in addresses if a.startswith("tcp://"))


def _outsider_gets_an_answer(engine_input: str) -> bool:
    """A plain DEALER on the network sends a well-formed request, as any host could."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        # A refused CURVE handshake drops the connection; a blocking send would then wait forever.
        sock.setsockopt(zmq.SNDTIMEO, 2000)
        sock.connect(engine_input)
        try:
            sock.send_multipart([RequestType.ADD.value, encode(Request("intruder-1", [9], 2))])
        except zmq.Again:
            return False
        return bool(sock.poll(5000))
    finally:
        ctx.destroy(linger=0)


def _outsider_hears_snapshots(publish: str) -> bool:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(publish)
        return bool(sock.poll(5000))  # the coordinator publishes at least every heartbeat (1 s)
    finally:
        ctx.destroy(linger=0)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("auth", ["curve", "none"])
def test_only_key_holders_reach_the_cluster_over_tcp(two_nodes, auth: str) -> None:  # type: ignore[no-untyped-def]
    with raydp.launch(name=f"auth-{auth}", dp_size=2, auth=auth, progress=False) as cluster:
        assert (cluster.endpoints.curve is not None) == (auth == "curve")
        open_door = auth == "none"
        assert _outsider_gets_an_answer(_tcp(cluster.endpoints.engines[1].input_addresses)) is open_door
        assert _outsider_hears_snapshots(_tcp(cluster.endpoints.coordinator.publish)) is open_door
        client = cluster.client()  # holds the keys, on either node
        assert [client.generate([3], max_tokens=2, rank=r, timeout=60) for r in (0, 1)] == [[3, 3], [3, 3]]
