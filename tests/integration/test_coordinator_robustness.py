"""Garbage on any coordinator socket is dropped; the coordinator keeps serving.

The garbage comes from a peer holding the cluster's keys (a buggy member, the
worst case CURVE lets through); outsiders are refused before decoding
(tests/integration/test_security.py).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import pytest
import zmq

import raydp
from raydp.wire.codec import encode
from raydp.wire.control import EngineStats
from raydp.wire.protocol import Request
from raydp.wire.transport import SocketOptions, make_socket
from tests.integration.helpers import wait_until


def tcp_endpoint(addresses: list[str]) -> tuple[str, int]:
    host, port = next(a for a in addresses if a.startswith("tcp://"))[len("tcp://") :].rsplit(":", 1)
    return host, int(port)


def raw_tcp_garbage(addresses: list[str]) -> None:
    """Bytes that are not even ZMTP: the socket layer must shrug them off."""
    with socket.create_connection(tcp_endpoint(addresses), timeout=5) as s:
        s.sendall(os.urandom(512))
        time.sleep(0.05)


@pytest.mark.timeout(180)
def test_garbage_on_every_socket_leaves_the_coordinator_serving(two_nodes: Any) -> None:
    with raydp.launch(name="robust", dp_size=2, progress=False) as cluster:
        coord = cluster.endpoints.coordinator
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            member = SocketOptions(curve=cluster.endpoints.curve)
            push = make_socket(ctx, zmq.PUSH, member)
            push.connect(coord.collect[-1])
            for junk in (b"", b"\xc1", os.urandom(64), encode(Request("r", [1])), b"\x93\x04\xa1x\x00"):
                push.send(junk)
            push.send_multipart([b"two", b"frames"])
            assert wait_until(lambda: cluster.coordinator_state().dropped >= 6, timeout=10)
            before = cluster.coordinator_state().dropped
            xsub = make_socket(ctx, zmq.XSUB, member)
            xsub.connect(coord.broadcast[-1])
            forged_rank_9 = b"\x01\xffrank\x09\x00"
            for junk in (b"\x01\xffrank\x05", forged_rank_9, b"\x01\xffrank\x05\x00\x00\x00", b"\x00"):
                xsub.send(junk)
            # A subscription claiming a rank the cluster does not have is dropped, not believed.
            assert wait_until(lambda: cluster.coordinator_state().dropped > before, timeout=10)
            to_publish = make_socket(ctx, zmq.XSUB, member)
            to_publish.connect(coord.publish[-1])
            to_publish.send(b"\x01")
            to_publish.send(os.urandom(32))
            for addresses in (coord.collect, coord.broadcast, coord.publish):
                raw_tcp_garbage(addresses)
            # The next valid message is handled as usual...
            push.send(encode(EngineStats(rank=1, waiting=7, running=3)))
            assert wait_until(lambda: cluster.coordinator_state().counts[1] == [7, 3], timeout=10)
            # ...engines still count as subscribed, clients still get snapshots and answers.
            assert cluster.coordinator_state().subscribed == [0, 1]
            client = cluster.client()
            assert wait_until(lambda: client.snapshot() is not None, timeout=10)
            assert client.generate([3], max_tokens=2, timeout=30) == [3, 3]
        finally:
            ctx.destroy(linger=0)
