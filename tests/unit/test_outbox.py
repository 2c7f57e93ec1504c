"""The engine's outbox over a real ROUTER: a client that stops reading is backlogged, then given up."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from raydp.engine.outbox import BACKLOG_LIMIT, Outbox

pytestmark = pytest.mark.timeout(30)


class RouterSender:
    """What EngineSockets.send_to does for one ROUTER."""

    def __init__(self, router: zmq.Socket[bytes]) -> None:
        self.router = router

    def send_to(self, client: bytes, body: bytes) -> None:
        self.router.send_multipart([client, body], flags=zmq.NOBLOCK)


@pytest.fixture
def wired() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.SNDHWM, 1)
    router.bind("inproc://outbox")
    client = ctx.socket(zmq.DEALER)
    client.setsockopt(zmq.RCVHWM, 1)
    client.setsockopt(zmq.IDENTITY, b"slow")
    client.connect("inproc://outbox")
    client.send(b"hello")  # the ROUTER learns the identity
    assert router.poll(5000)
    router.recv_multipart()
    yield router, client
    ctx.destroy(linger=0)


def test_a_client_that_stops_reading_gets_everything_in_order_once_it_reads(wired) -> None:  # type: ignore[no-untyped-def]
    router, client = wired
    lost: list[tuple[bytes, str]] = []
    box = Outbox(RouterSender(router), lambda c, why: lost.append((c, why)))
    for i in range(50):
        box.send(b"slow", str(i).encode())
    assert box.behind, "the queue filled: the rest wait in the backlog, the sender did not block"
    got: list[int] = []
    deadline = time.monotonic() + 10
    while len(got) < 50 and time.monotonic() < deadline:
        if client.poll(10):
            got.append(int(client.recv()))
        router.poll(0)  # as the engine loop polls between steps: the ROUTER learns there is room
        box.flush()
    assert got == list(range(50)) and not box.behind and lost == []


def test_a_client_too_far_behind_is_given_up(wired) -> None:  # type: ignore[no-untyped-def]
    router, _ = wired
    lost: list[tuple[bytes, str]] = []
    box = Outbox(RouterSender(router), lambda c, why: lost.append((c, why)))
    for _ in range(BACKLOG_LIMIT + 10):
        box.send(b"slow", b"x")
    assert len(lost) == 1 and lost[0][0] == b"slow" and "batches behind" in lost[0][1]


def test_an_unknown_client_is_reported_disconnected(wired) -> None:  # type: ignore[no-untyped-def]
    router, _ = wired
    lost: list[tuple[bytes, str]] = []
    box = Outbox(RouterSender(router), lambda c, why: lost.append((c, why)))
    box.send(b"gone", b"x")
    assert lost == [(b"gone", "disconnected")] and not box.behind
