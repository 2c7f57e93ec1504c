"""``serve_on_socket`` in a thread (as a Ray actor hosts it): serves, then returns when told to stop."""

from __future__ import annotations

import asyncio
import http.client
import socket
import threading
import time

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from raydp.errors import ConfigError
from raydp.serve.server import serve_on_socket

pytestmark = pytest.mark.timeout(60)


async def hello(request: Request) -> PlainTextResponse:
    return PlainTextResponse("hello")


def test_it_serves_a_listening_socket_until_the_stop_event() -> None:
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    stop = threading.Event()
    thread = threading.Thread(
        target=serve_on_socket,
        args=(sock, Starlette(routes=[Route("/", hello)])),
        kwargs={"stop": stop, "graceful_shutdown_s": 1.0},
    )
    thread.start()
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/")
        resp = conn.getresponse()
        assert (resp.status, resp.read()) == (200, b"hello")
        conn.close()
    finally:
        stop.set()
        start = time.monotonic()
        thread.join(timeout=10)
    assert not thread.is_alive() and time.monotonic() - start < 9, "returned soon after stop"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=5)


def test_bad_limits_are_config_errors_naming_the_field() -> None:
    with socket.create_server(("127.0.0.1", 0)) as sock, pytest.raises(ConfigError, match=r"idle_timeout_s=0"):
        serve_on_socket(sock, Starlette(), idle_timeout_s=0)


def test_a_request_still_running_after_the_grace_gets_the_answer_that_on_grace_over_makes() -> None:
    """The drain order: stop accepting, the grace, ``on_grace_over`` ends what runs, its answer goes out, return."""
    released: list[asyncio.Event] = []

    async def forever(request: Request) -> PlainTextResponse:
        released.append(asyncio.Event())
        await released[-1].wait()
        return PlainTextResponse("shutting down", status_code=503)

    def grace_over() -> None:
        released[0].set()  # the request's event: it exists by then

    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    stop = threading.Event()
    thread = threading.Thread(
        target=serve_on_socket,
        args=(sock, Starlette(routes=[Route("/", forever)])),
        kwargs={"stop": stop, "graceful_shutdown_s": 0.5, "on_grace_over": grace_over},
    )
    thread.start()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/")
        deadline = time.monotonic() + 10
        while not released and time.monotonic() < deadline:
            time.sleep(0.01)
        assert released, "the request reached the app"
        stop.set()
        resp = conn.getresponse()
        assert (resp.status, resp.read()) == (503, b"shutting down")
    finally:
        conn.close()
        stop.set()
        thread.join(timeout=10)
    assert not thread.is_alive()
