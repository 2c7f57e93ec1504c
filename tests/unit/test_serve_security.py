"""API keys, HTTPS and the over-capacity answer of ``serve_on_socket``, over real sockets (no Ray).

The app is a small Starlette one wrapped as :func:`~raydp.serve.app.build_app`
wraps the API: the :class:`~raydp.serve.api_keys.ApiKeys` middleware before
the routes. Clients are the standard library's, as plain as a probe is.
"""

from __future__ import annotations

import hmac
import http.client
import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from raydp.errors import ConfigError
from raydp.serve.api_keys import ApiKeys
from raydp.serve.server import Tls, serve_on_socket
from raydp.serve.settings import ServeEnvironment, ServerSettings
from tests.tls_certs import Pki, make_pki

pytestmark = pytest.mark.timeout(120)
KEYS = ["sk-first-0123456789abcdef", "sk-second-fedcba9876543210"]


async def ok(request: Request) -> PlainTextResponse:
    return PlainTextResponse("secret data")


def app(keys: list[str], protect_metrics: bool = False) -> Starlette:
    routes = [Route(path, ok) for path in ("/v1/models", "/health", "/metrics")]
    return Starlette(routes=routes, middleware=[Middleware(ApiKeys, keys=keys, protect_metrics=protect_metrics)])


@contextmanager
def serving(asgi: Starlette, **kwargs: Any) -> Iterator[int]:
    sock = socket.create_server(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    stop = threading.Event()
    thread = threading.Thread(target=serve_on_socket, args=(sock, asgi), kwargs={"stop": stop, **kwargs})
    thread.start()
    try:
        yield port
    finally:
        stop.set()
        thread.join(timeout=10)
        sock.close()
    assert not thread.is_alive()


def get(conn: http.client.HTTPConnection, path: str, key: str | None = None) -> tuple[int, bytes, Any]:
    conn.request("GET", path, headers={"Authorization": f"Bearer {key}"} if key is not None else {})
    resp = conn.getresponse()
    return resp.status, resp.read(), resp


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_v1_routes_need_one_of_the_keys_and_refuse_others_in_openais_shape() -> None:
    with serving(app(KEYS)) as port:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        assert get(conn, "/v1/models", KEYS[0])[:2] == (200, b"secret data")
        assert get(conn, "/v1/models", KEYS[1])[:2] == (200, b"secret data")
        for key in (None, "sk-wrong", KEYS[0][:-1], KEYS[0] + "x", ""):
            status, body, resp = get(conn, "/v1/models", key)
            error = json.loads(body)["error"]
            assert status == 401 and error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
            assert resp.getheader("WWW-Authenticate") == "Bearer" and b"secret" not in body
            assert all(k not in body.decode() for k in KEYS), "a refusal never echoes a key"
        conn.request("GET", "/v1/models", headers={"Authorization": f"Basic {KEYS[0]}"})
        basic = conn.getresponse()
        assert (basic.status, json.loads(basic.read())["error"]["code"]) == (401, "invalid_api_key"), "Bearer only"
        assert get(conn, "/health")[:2] == (200, b"secret data"), "/health stays open"
        assert get(conn, "/metrics")[:2] == (200, b"secret data"), "/metrics is open by default"


def test_protected_metrics_need_a_key_and_no_keys_means_no_check() -> None:
    with serving(app(KEYS, protect_metrics=True)) as port:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        assert get(conn, "/metrics")[0] == 401
        assert get(conn, "/metrics", KEYS[1])[0] == 200
        assert get(conn, "/health")[0] == 200
    with serving(app([])) as port:
        assert get(http.client.HTTPConnection("127.0.0.1", port, timeout=10), "/v1/models")[0] == 200


def test_every_key_is_compared_whole_as_equal_length_digests_whatever_is_presented(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What makes the check's time independent of the key: each presented key, right or wrong, long or
    short, is compared with every configured key, as 32-byte digests, by hmac.compare_digest.

    (A timing measurement over HTTP could not fail here: an early-exit comparison of 25 bytes differs
    by nanoseconds, under microseconds of noise. The mechanism is what can be checked.)
    """
    compared: list[tuple[int, int]] = []
    real = hmac.compare_digest

    def counted(a: bytes, b: bytes) -> bool:
        compared.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counted)
    presented = [KEYS[0], KEYS[1], "X" + KEYS[0][1:], KEYS[0][:-1] + "X", "short", "x" * 400]
    with serving(app(KEYS)) as port:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        for key in presented:
            compared.clear()
            status = get(conn, "/v1/models", key)[0]
            assert status == (200 if key in KEYS else 401), key
            assert compared == [(32, 32)] * len(KEYS), (key, compared)
    middleware = ApiKeys(app([]), keys=KEYS)
    assert not any(key in repr(vars(middleware)) for key in KEYS), "only the keys' digests are kept"


def test_keys_are_validated_without_ever_showing_them() -> None:
    for keys in (["has space"], [""], ["x" * 513], ["tab\tkey"], "a-string"):
        with pytest.raises(ConfigError, match="api_keys") as info:
            ServerSettings(api_keys=keys)
        assert "has space" not in str(info.value) and "tab" not in str(info.value)
    settings = ServerSettings(api_keys=KEYS)
    assert KEYS[0] not in repr(settings) and KEYS[0] not in str(settings.model_dump())
    with pytest.raises(ConfigError, match="protect_metrics=True: needs at least one API key"):
        ServerSettings(protect_metrics=True)


def test_the_environment_gives_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYDP_API_KEY", KEYS[1])
    key = ServeEnvironment().api_key
    assert key is not None and key.get_secret_value() == KEYS[1] and KEYS[1] not in repr(key)
    monkeypatch.delenv("RAYDP_API_KEY")
    assert ServeEnvironment().api_key is None


def test_tls_files_are_checked(pki: Pki, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ssl_keyfile=None: HTTPS needs both"):
        ServerSettings(ssl_certfile=str(pki.server_cert))
    with pytest.raises(ConfigError, match=r"ssl_certfile: '/nonexistent.pem' is no file"):
        ServerSettings(ssl_certfile="/nonexistent.pem", ssl_keyfile=str(pki.server_key))
    with pytest.raises(ConfigError, match=r"ssl_ca_certs=.*client certificates need HTTPS"):
        ServerSettings(ssl_ca_certs=str(pki.ca))
    tls = ServerSettings(ssl_certfile=str(pki.server_cert), ssl_keyfile=str(pki.server_key))
    assert tls.scheme == "https" and ServerSettings().scheme == "http"


def test_https_serves_and_plain_http_to_it_gets_no_answer(pki: Pki) -> None:
    with serving(app(KEYS), tls=Tls(str(pki.server_cert), str(pki.server_key))) as port:
        context = ssl.create_default_context(cafile=str(pki.ca))
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=context)
        assert get(conn, "/v1/models", KEYS[0])[:2] == (200, b"secret data")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as plain:
            plain.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEYS[0]}\r\n\r\n".encode())
            answer = _read_all(plain)
        assert not answer.startswith(b"HTTP/") and b"secret" not in answer, answer
        untrusted = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=ssl.create_default_context())
        with pytest.raises(ssl.SSLCertVerificationError):
            untrusted.request("GET", "/health")


def test_with_a_ca_for_clients_only_certified_clients_get_through(pki: Pki) -> None:
    with serving(app([]), tls=Tls(str(pki.server_cert), str(pki.server_key), str(pki.ca))) as port:
        certified = ssl.create_default_context(cafile=str(pki.ca))
        certified.load_cert_chain(pki.client_cert, pki.client_key)
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=certified)
        assert get(conn, "/v1/models")[:2] == (200, b"secret data")
        anonymous = http.client.HTTPSConnection(
            "127.0.0.1", port, timeout=10, context=ssl.create_default_context(cafile=str(pki.ca))
        )
        with pytest.raises((ssl.SSLError, ConnectionError, http.client.RemoteDisconnected)):
            get(anonymous, "/v1/models")


def test_past_max_connections_a_request_gets_a_json_503() -> None:
    with serving(app([]), max_connections=2) as port:
        first = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        assert get(first, "/health")[0] == 200  # one connection, kept alive: under the limit
        second = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        status, body, resp = get(second, "/health")
        assert status == 503 and resp.getheader("content-type") == "application/json"
        assert json.loads(body)["error"]["code"] == "server_overloaded"
        first.close()
        deadline = time.monotonic() + 10
        while get(http.client.HTTPConnection("127.0.0.1", port, timeout=10), "/health")[0] != 200:
            assert time.monotonic() < deadline, "served again once connections closed"
            time.sleep(0.05)


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := sock.recv(4096):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data
