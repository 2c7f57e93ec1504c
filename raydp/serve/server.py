"""Run the API app with uvicorn on a socket that N processes share.

:func:`serve_on_socket` blocks until SIGINT or SIGTERM (in the main thread)
or ``stop`` is set, lets running requests finish for a grace period, and
returns; with ``on_grace_over`` it then calls it to end the requests still
running, gives their answers ``FLUSH_S`` to go out, and returns (any number
of signals means one such stop: :mod:`.draining`). Connection limits, all
per process:

* a connection idle (no request in progress) for ``idle_timeout_s`` is closed,
  a new one that never sends a byte included;
* a request must arrive whole (head and body) within ``read_timeout_s`` of its
  first byte, so a slow-loris client cannot hold a slot (:mod:`.protocol`);
* a request head still unfinished past 16 KiB is a 400 (h11's bound), a
  body over ``max_body_bytes`` a 413 (the app's);
* past ``max_connections`` open connections, new requests get a 503 in
  OpenAI's JSON error shape until connections close (:mod:`.protocol`).

With TLS files (:class:`Tls`) the socket serves HTTPS only: a plain-HTTP
request to it fails the TLS handshake and gets no HTTP answer. Every process
on the shared socket wraps its own connections.

:func:`serve_forever` is the body of an API server process
(:mod:`.processes`): a client of the cluster, the app over it, served here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import ssl
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType

import uvicorn
from starlette.types import ASGIApp

from raydp.serve.app import build_app
from raydp.serve.draining import FLUSH_S, InFlight
from raydp.serve.protocol import QUIET_MALFORMED, guarded_protocol
from raydp.serve.settings import ServerSettings
from raydp.wire.endpoints import ClusterEndpoints

MAX_HEAD_BYTES = 16 * 1024  # h11's default, stated: a head still unfinished past it is refused with a 400
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass(frozen=True)
class Tls:
    """HTTPS files (PEM): all None serves plain HTTP; ``ca_certs`` makes client certificates required."""

    certfile: str | None = None
    keyfile: str | None = None
    ca_certs: str | None = None

    @classmethod
    def of(cls, settings: ServerSettings) -> Tls:
        return cls(settings.ssl_certfile, settings.ssl_keyfile, settings.ssl_ca_certs)


class _Server(uvicorn.Server):
    """uvicorn's server, stoppable by an event, returning (not re-raising) after a signal.

    ``on_grace_over`` is called ``grace_s`` into the shutdown if it is still waiting for requests;
    ``on_serving`` once it accepts connections.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        stop: threading.Event | None,
        on_grace_over: Callable[[], None] | None = None,
        grace_s: float = 0.0,
        on_serving: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(config)
        self._stop = stop
        self._on_grace_over, self._grace_s = on_grace_over, grace_s
        self._on_serving = on_serving

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self._on_serving is not None:
            self._on_serving()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A repeated signal must not force an exit that cuts answers off: a
        # terminal's Ctrl-C reaches the whole process group, and the launcher's
        # SIGTERM follows it; ``ray job stop`` signals every process of the job.
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = None
        if self._on_grace_over is not None:
            timer = asyncio.get_running_loop().call_later(self._grace_s, self._on_grace_over)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()

    async def on_tick(self, counter: int) -> bool:
        if self._stop is not None and self._stop.is_set():
            self.should_exit = True
        return await super().on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises a caught signal after shutdown; the caller wants to
        # return and clean up (close its client), so the old handlers are only restored.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve_on_socket(
    sock: socket.socket,
    app: ASGIApp,
    *,
    idle_timeout_s: float = 5.0,
    read_timeout_s: float = 10.0,
    max_connections: int = 2048,
    graceful_shutdown_s: float = 3.0,
    stop: threading.Event | None = None,
    on_grace_over: Callable[[], None] | None = None,
    tls: Tls | None = None,
    on_serving: Callable[[], None] | None = None,
) -> None:
    """Serve ``app`` on the listening ``sock`` until a stop signal or ``stop``; see the module docstring.

    With ``tls`` it serves HTTPS only; ``on_serving`` is called once it accepts connections.
    """
    ServerSettings(
        idle_timeout_s=idle_timeout_s,
        read_timeout_s=read_timeout_s,
        max_connections=max_connections,
        graceful_shutdown_s=graceful_shutdown_s,
    )  # raises ConfigError
    tls = tls or Tls()
    logging.getLogger("uvicorn.error").addFilter(QUIET_MALFORMED)  # the protocol logs those, with their sender
    wait_s = graceful_shutdown_s + (FLUSH_S if on_grace_over else 0.0)  # then uvicorn cancels what is left
    config = uvicorn.Config(
        app,
        http=guarded_protocol(read_timeout_s),
        ws="none",
        lifespan="on",
        log_config=None,  # keep the process's logging as raydp set it up
        access_log=False,
        proxy_headers=False,
        server_header=False,
        # uvicorn annotates these int, but only hands them to loop.call_later / asyncio.wait_for.
        timeout_keep_alive=idle_timeout_s,  # type: ignore[arg-type]
        timeout_graceful_shutdown=wait_s,  # type: ignore[arg-type]
        limit_concurrency=max_connections,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        ssl_certfile=tls.certfile,
        ssl_keyfile=tls.keyfile,
        ssl_ca_certs=tls.ca_certs,
        ssl_cert_reqs=ssl.CERT_REQUIRED if tls.ca_certs else ssl.CERT_NONE,
    )
    _Server(config, stop, on_grace_over, graceful_shutdown_s, on_serving).run(sockets=[sock])


def serve_forever(
    sock: socket.socket,
    endpoints: ClusterEndpoints,
    client_index: int,
    client_count: int,
    node_id: str | None,
    *,
    ranks: list[int] | None = None,
    settings: ServerSettings | None = None,
    stop: threading.Event | None = None,
    on_serving: Callable[[], None] | None = None,
) -> None:
    """Run one API server on ``sock`` until a stop signal or ``stop``; it routes only to ``ranks`` if given.

    Requests still running ``graceful_shutdown_s`` into the stop get a 503 (:mod:`.draining`).
    """
    s = settings or ServerSettings()
    client = s.client(endpoints, client_index, client_count, node_id, ranks)
    in_flight = InFlight()
    reason = (
        f"API server {client_index} of {endpoints.name!r} is shutting down: the request was still running "
        f"after graceful_shutdown_s={s.graceful_shutdown_s:g}"
    )
    try:
        app = build_app(
            client,
            model=s.model or endpoints.name,
            max_body_bytes=s.max_body_bytes,
            request_timeout_s=s.request_timeout_s,
            max_tokens_limit=s.max_tokens_limit,
            vocab_size=s.vocab_size,
            in_flight=in_flight,
            tokenizer=s.tokenizer,
            api_keys=[k.get_secret_value() for k in s.api_keys],
            protect_metrics=s.protect_metrics,
            ready_quorum=s.ready_quorum,
        )
        serve_on_socket(
            sock,
            app,
            idle_timeout_s=s.idle_timeout_s,
            read_timeout_s=s.read_timeout_s,
            max_connections=s.max_connections,
            graceful_shutdown_s=s.graceful_shutdown_s,
            stop=stop,
            on_grace_over=lambda: in_flight.fail_all(reason),
            tls=Tls.of(s),
            on_serving=on_serving,
        )
    finally:
        client.close()
