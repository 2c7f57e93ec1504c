"""CURVE over real TCP sockets: members get through, everyone else is refused."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from raydp.wire.security import CurveKeys, Gatekeeper
from raydp.wire.transport import IpcDir, SocketOptions, bind_inputs, input_options, make_socket

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def server() -> Iterator[tuple[zmq.Socket[bytes], str, CurveKeys]]:
    """A secured PULL on 127.0.0.1, as engines and the coordinator bind theirs."""
    keys = CurveKeys.generate()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    gate = Gatekeeper(ctx, keys)
    sock = make_socket(ctx, zmq.PULL, SocketOptions(curve=keys), serves=True)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, f"tcp://127.0.0.1:{port}", keys
    gate.stop()
    ctx.destroy(linger=0)


def _send_from(address: str, opts: SocketOptions) -> None:
    """Send one message and give it half a second to leave (what a refused peer gets)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = make_socket(ctx, zmq.PUSH, opts)
    sock.connect(address)
    sock.send(b"hello")
    ctx.destroy(linger=500)


def test_a_member_gets_through(server: tuple[zmq.Socket[bytes], str, CurveKeys]) -> None:
    sock, address, keys = server
    _send_from(address, SocketOptions(curve=keys, linger_ms=500))
    assert sock.poll(5000), "the member's message arrives"
    assert sock.recv() == b"hello"


@pytest.mark.parametrize("who", ["plain", "wrong member key", "wrong server key"])
def test_an_outsider_is_refused(server: tuple[zmq.Socket[bytes], str, CurveKeys], who: str) -> None:
    sock, address, keys = server
    other = CurveKeys.generate()
    curve = {
        "plain": None,
        "wrong member key": CurveKeys(keys.server_public, b"", other.member_public, other.member_secret),
        "wrong server key": CurveKeys(other.server_public, b"", keys.member_public, keys.member_secret),
    }[who]
    _send_from(address, SocketOptions(curve=curve, linger_ms=500))
    assert not sock.poll(1000), f"{who}: nothing may arrive"
    _send_from(address, SocketOptions(curve=keys, linger_ms=500))
    assert sock.poll(5000), "members still get through after a refusal"


def test_a_stopped_gatekeeper_fails_closed() -> None:
    """Without a ZAP handler libzmq would admit any key pair; raydp's servers refuse everyone instead."""
    keys = CurveKeys.generate()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        gate = Gatekeeper(ctx, keys)
        sock = make_socket(ctx, zmq.PULL, SocketOptions(curve=keys), serves=True)
        address = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
        _send_from(address, SocketOptions(curve=keys, linger_ms=500))
        assert sock.poll(5000) and sock.recv() == b"hello", "open while the gatekeeper runs"
        gate.stop()
        stranger = CurveKeys.generate()
        for curve in (keys, CurveKeys(keys.server_public, b"", stranger.member_public, stranger.member_secret)):
            _send_from(address, SocketOptions(curve=curve, linger_ms=500))
        assert not sock.poll(1000), "neither a member nor a stranger gets in once it has stopped"
    finally:
        ctx.destroy(linger=0)


def test_keys_never_show_their_secrets() -> None:
    keys = CurveKeys.generate()
    for text in (repr(keys), repr(keys.__rich_repr__())):
        assert keys.server_public.decode() in text
        assert keys.server_secret.decode() not in text
        assert keys.member_secret.decode() not in text


def test_engine_inputs_are_plain_on_ipc_and_curve_on_tcp() -> None:
    keys = CurveKeys.generate()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    ipc_dir = IpcDir("unit-inputs")
    gate = Gatekeeper(ctx, keys)
    try:
        socks, addresses = bind_inputs(ctx, SocketOptions(curve=keys), "auto", ipc_dir)
        assert [a.split("://")[0] for a in addresses] == ["ipc", "tcp"]
        assert [s.getsockopt(zmq.CURVE_SERVER) for s in socks] == [0, 1]
        member = SocketOptions(curve=keys)
        assert input_options(member, addresses[0]).curve is None, "a same-node client connects plainly"
        assert input_options(member, addresses[1]).curve == keys
        for address in addresses:  # each door answers the options its connectors are given
            client = make_socket(ctx, zmq.DEALER, input_options(member, address), identity=b"c")
            client.connect(address)
            client.send(b"hi")
            poller = zmq.Poller()
            for sock in socks:
                poller.register(sock, zmq.POLLIN)
            ready = [sock for sock, _ in poller.poll(5000)]
            assert ready == [socks[addresses.index(address)]]
            assert ready[0].recv_multipart() == [b"c", b"hi"]
            client.close(linger=0)
    finally:
        gate.stop()
        ctx.destroy(linger=0)
        ipc_dir.remove()
