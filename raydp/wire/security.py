"""CURVE authentication for a cluster's sockets.

Each launch makes two key pairs: the *server* pair, which every binding
socket (engine inputs, the coordinator's three sockets, the handshake ROUTER)
presents, and the *member* pair, which every connecting socket presents. A
:class:`Gatekeeper` (a ZAP handler on each context that binds) admits only
the member key, so a peer that was not handed the keys cannot connect, send a
request, or forge a control message; traffic is encrypted as well.

The keys travel only through Ray (actor arguments, the coordinator's
``cluster()`` answer) and multiprocessing pipes, never over ZMQ and never to
a file raydp writes; their ``repr`` hides the secrets so logs do not leak
them. Whoever can use the Ray cluster can read them, as any actor state.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import zmq
from zmq.auth.thread import ThreadAuthenticator

from raydp.wire.dropped import DropLog

ZAP_DOMAIN = "raydp"
logger = logging.getLogger("raydp.wire.security")


class CurveKeys(msgspec.Struct, frozen=True):
    """One cluster's key pairs (Z85 text, as libzmq takes them)."""

    server_public: bytes
    server_secret: bytes
    member_public: bytes
    member_secret: bytes

    @classmethod
    def generate(cls) -> CurveKeys:
        server_public, server_secret = zmq.curve_keypair()
        member_public, member_secret = zmq.curve_keypair()
        return cls(server_public, server_secret, member_public, member_secret)

    def __repr__(self) -> str:
        return f"CurveKeys(server_public={self.server_public.decode()!r}, secrets hidden)"

    def __rich_repr__(self) -> list[tuple[str, Any]]:
        # msgspec would otherwise hand rich (notebook pretty-printing) every field.
        return [("server_public", self.server_public.decode())]


def secure_server(sock: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Make a binding socket demand CURVE; its context needs a running :class:`Gatekeeper`."""
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    # Fail closed: without this, libzmq admits any key pair whenever no ZAP
    # handler is running (e.g. between a gatekeeper's stop and the close).
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


def secure_client(sock: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Make a connecting socket prove it is a member of the cluster."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.member_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.member_secret)


class _MembersOnly:
    """The ZAP decision. A refused peer retries every reconnect interval (100 ms), so refusals
    are logged at most once a second per key (:class:`~raydp.wire.dropped.DropLog`)."""

    def __init__(self, member_public: bytes) -> None:
        self._member = member_public
        self._refusals = DropLog(logger, "gatekeeper", what="connection")

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = key == self._member
        if not allowed:
            self._refusals.drop(f"CURVE key {key.decode(errors='replace')}", "an unknown CURVE key is refused")
        return allowed


class Gatekeeper:
    """The ZAP handler of one context: admits connections with the member key only.

    Start it before any secured socket of the context binds (without a handler
    libzmq admits everyone), and stop it before the context is destroyed.
    """

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], keys: CurveKeys) -> None:
        self._auth: ThreadAuthenticator | None = ThreadAuthenticator(ctx, log=logger)
        self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_MembersOnly(keys.member_public))
        self._auth.start()

    def stop(self) -> None:
        auth, self._auth = self._auth, None
        if auth is not None:
            auth.stop()


def guard(ctx: zmq.Context[zmq.Socket[bytes]], keys: CurveKeys | None) -> Gatekeeper | None:
    """A running :class:`Gatekeeper` for ``ctx``, or None when the cluster does not use CURVE."""
    return Gatekeeper(ctx, keys) if keys is not None else None
