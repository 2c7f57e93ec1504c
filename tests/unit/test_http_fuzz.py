"""HTTP fuzzing: generated request lines, headers and bodies over raw loopback sockets.

The real app (``build_app``) over a real ``Client`` and a real engine loop
(EchoEngine), served by ``serve_on_socket`` in a thread. Every answer is a
well-formed 4xx in OpenAI's JSON error shape, a 2xx, or a clean close;
unparseable requests are logged once per client address a second, not once
each; and the server keeps serving ``/health`` and real completions.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import re
import socket
import string
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from raydp.client.client import Client
from raydp.serve.app import build_app
from raydp.serve.server import serve_on_socket
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint
from raydp.wire.transport import SocketOptions, make_socket
from tests.unit.wire_targets import FUZZ, drop_lines, engine, rate_bound, wait_until, zmq_context

pytestmark = pytest.mark.timeout(90)


MAX_BODY = 4096


@contextlib.contextmanager
def http_server() -> Iterator[tuple[str, int]]:
    """The real app over a real client and a real engine loop, served on a loopback socket."""
    with engine("plain") as eng, zmq_context() as ctx:
        publish = make_socket(ctx, zmq.PUB, SocketOptions())
        collect = make_socket(ctx, zmq.PULL, SocketOptions())
        stub = {s: f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}" for s in (publish, collect)}
        client = Client(
            ClusterEndpoints(
                "fuzz",
                [EngineEndpoint(0, "n", [eng.address])],
                CoordinatorEndpoints("n", [stub[publish]], [stub[collect]], [stub[collect]]),
                lockstep=False,
            ),
            node_id="n",
            follow_liveness=False,
        )
        app = build_app(client, model="fuzz", max_body_bytes=MAX_BODY, max_tokens_limit=32, vocab_size=256)
        listener = socket.create_server(("127.0.0.1", 0))
        address = listener.getsockname()
        stop = threading.Event()
        server = threading.Thread(
            target=serve_on_socket,
            args=(listener, app),
            daemon=True,
            kwargs={"idle_timeout_s": 1.0, "read_timeout_s": 1.0, "graceful_shutdown_s": 0.5, "stop": stop},
        )
        server.start()
        try:
            assert wait_until(lambda: _health(address) is not None, timeout=15), "the server did not start"
            yield address
        finally:
            stop.set()
            server.join(timeout=10)
            client.close()


def _health(address: tuple[str, int]) -> dict[str, Any] | None:
    try:
        conn = http.client.HTTPConnection(*address, timeout=5)
        conn.request("GET", "/health")
        resp = conn.getresponse()
        body = resp.read()
        conn.close()
    except OSError:
        return None
    return json.loads(body) if resp.status == 200 else None


def exchange(address: tuple[str, int], raw: bytes, half_close: bool = False) -> bytes:
    """Send ``raw`` on a new connection; everything the server sends until it closes."""
    data = b""
    with socket.create_connection(address, timeout=10) as sock:
        try:
            sock.sendall(raw)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(65536):
                data += chunk
        except ConnectionResetError:
            pass  # a clean close, as far as the client can tell: the server refused the rest unread
    return data


def check_answer(data: bytes) -> int | None:
    """The first answer's status (None: the server closed without one); a 4xx must be OpenAI's JSON error shape.

    Bytes past the first request's end (its head ended early, at a bare blank line) are a pipelined next
    request: its answer follows the first one's, and is checked the same way.
    """
    while re.match(rb"HTTP/1\.1 1\d\d ", data):  # interim answers (Expect: 100-continue)
        data = data.partition(b"\r\n\r\n")[2]
    if not data:
        return None
    head, sep, body = data.partition(b"\r\n\r\n")
    assert sep, data[:300]
    status_line, *header_lines = head.split(b"\r\n")
    m = re.fullmatch(rb"HTTP/1\.1 (\d{3}) [ -~]*", status_line)
    assert m, status_line
    status = int(m[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(b":") for h in header_lines)}
    assert 200 <= status < 500, (status, body[:300])
    if status >= 400:
        assert headers.get(b"content-type") == b"application/json", (status, headers, body[:200])
        length = int(headers[b"content-length"])
        body, rest = body[:length], body[length:]
        assert len(body) == length, (status, body[:200])
        if rest:
            assert rest.startswith(b"HTTP/1.1 "), (status, rest[:200])
            check_answer(rest)
        error = json.loads(body)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error", error
    return status


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
FIELDS = ("prompt", "max_tokens", "stream", "model", "prompt_token_ids", "rank", "echo", "n")
json_bodies = st.one_of(
    json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({}, optional={f: json_values | st.integers(-5, 40) for f in FIELDS}).map(
        lambda d: json.dumps(d).encode()
    ),
    json_values.map(lambda v: json.dumps(v).encode()).flatmap(lambda b: st.integers(0, len(b)).map(lambda n: b[:n])),
    st.binary(max_size=200),
)
TOKEN = string.ascii_letters + string.digits + "!#$%&'*+-.^_`|~"
FRAMING = {b"content-length", b"transfer-encoding", b"connection"}  # set by the test, so the server always answers


@st.composite
def http_requests(draw: st.DrawFn) -> bytes:
    """A request line, headers and a body, each of them right or wrong; framed by Content-Length, then closed."""
    if draw(st.booleans()):
        method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]))
        target = draw(
            st.sampled_from(
                [
                    "/v1/completions",
                    "/v1/generate",
                    "/health",
                    "/v1/models",
                    "/metrics",
                    "/",
                    "*",
                    "/v1/completions?x=1",
                    "/%ff",
                    "//v1//generate",
                ]
            )
        )
        version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2", "HTTP/1.1 x", "", "http/1.1"]))
        line = f"{method} {target} {version}".encode()
    else:
        line = draw(st.text(TOKEN + " /\t", max_size=40).map(str.encode) | st.binary(max_size=40))
    names = st.sampled_from([b"Content-Type", b"Accept", b"X-Fuzz", b"Expect", b"Host", b"Authorization"]) | st.binary(
        min_size=0, max_size=12
    )
    headers = [
        (n, v)
        for n, v in draw(st.lists(st.tuples(names, st.binary(max_size=40)), max_size=4))
        if n.strip().lower() not in FRAMING
    ]
    body = draw(json_bodies)
    head = line + b"\r\nHost: fuzz\r\n" + b"".join(n + b": " + v + b"\r\n" for n, v in headers)
    return head + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body


FRAMING_ATTACKS = [
    b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}",
    b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n{}",
    b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}x",
    b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n{}",
    b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n"
    b"2\r\n{}\r\n0\r\n\r\n",
    b"GET /health\r\n\r\n",
    b"\r\n\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(64)),  # a TLS hello on the plain port
    b"GET /health HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 20_000 + b"\r\n\r\n",  # a head past 16 KiB
    b"GET /health HTTP/1.1\r\n Folded: header\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header: x\r\n\r\n",
]


def test_http_fuzz_gets_openai_errors_or_a_clean_close(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    statuses: list[int | None] = []
    with http_server() as address:
        start = time.monotonic()

        @settings(FUZZ, max_examples=60)
        @given(raw=http_requests() | st.sampled_from(FRAMING_ATTACKS))
        def fuzz(raw: bytes) -> None:
            statuses.append(check_answer(exchange(address, raw)))

        fuzz()
        for raw in FRAMING_ATTACKS:  # each at least once, whatever the draw
            statuses.append(check_answer(exchange(address, raw)))
        elapsed = time.monotonic() - start
        # A body shorter than its Content-Length, then a half-close: no answer can come, the server just closes.
        cut = b'POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"prompt_token_ids": [1'
        assert check_answer(exchange(address, cut, half_close=True)) in (None, 400)
        assert _health(address) == {"status": "ok", "client_index": 0, "client_count": 1}
        conn = http.client.HTTPConnection(*address, timeout=10)
        conn.request(
            "POST",
            "/v1/completions",
            body=json.dumps({"prompt": [7, 8], "max_tokens": 3}),
            headers={"Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        assert resp.status == 200 and json.loads(resp.read())["choices"][0]["token_ids"] == [7, 8, 7]
        conn.close()
    assert 400 in statuses, "the fuzz never reached a refusal"
    assert not [r for r in caplog.records if r.getMessage() == "Invalid HTTP request received."], "uvicorn's line"
    lines = drop_lines(caplog, "api server")
    assert lines and all(": dropped a malformed HTTP request from HTTP client 127.0.0.1: " in line for line in lines)
    assert len(lines) <= rate_bound(1, elapsed)
