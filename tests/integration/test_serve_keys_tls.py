"""``raydp serve`` behind an API key and HTTPS, through the official ``openai`` SDK.

The real CLI (mp backend, echo engine, 2 ranks) with 2 API server
processes on one shared HTTPS socket, the key from ``RAYDP_API_KEY``, a CA
and certificate made by the test; the SDK trusts that CA. Logging is at
DEBUG, so that "the key appears in no log line" covers every line raydp
could write.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.integration.http_helpers import Served, raydp_serve
from tests.tls_certs import Pki, make_pki

pytestmark = pytest.mark.timeout(180)
KEY = "sk-raydp-test-7f3c9a0e5b1d4c2a"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def served(pki: Pki) -> Iterator[Served]:
    with raydp_serve(
        "--name",
        "keytls",
        "--engine",
        "echo",
        "--dp-size",
        "2",
        "--api-servers",
        "2",
        "--ssl-certfile",
        str(pki.server_cert),
        "--ssl-keyfile",
        str(pki.server_key),
        env={"RAYDP_API_KEY": KEY, "RAYDP_LOG_LEVEL": "DEBUG"},
    ) as s:
        yield s


def sdk(served: Served, pki: Pki, key: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{served.url}/v1",
        api_key=key,
        max_retries=0,
        timeout=60,
        http_client=openai.DefaultHttpxClient(verify=str(pki.ca)),
    )


def test_the_sdk_streams_over_https_with_the_key_from_every_api_server(served: Served, pki: Pki) -> None:
    assert served.url.startswith("https://127.0.0.1:")
    for _ in range(6):  # a new client, a new connection: over both processes sharing the socket
        client = sdk(served, pki, KEY)
        stream = client.completions.create(model="keytls", prompt=[72, 105, 33], max_tokens=6, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == "Hi!Hi!"  # the echo, byte tokenizer
    assert [m.id for m in client.models.list()] == ["keytls"]
    assert len(served.api_server_pids()) == 2


def test_no_key_or_a_wrong_one_is_refused_and_health_stays_open(served: Served, pki: Pki) -> None:
    for key in ("sk-wrong", KEY[:-1]):
        with pytest.raises(openai.AuthenticationError) as info:
            sdk(served, pki, key).completions.create(model="keytls", prompt=[1, 2], max_tokens=2)
        assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    bare = httpx.post(
        f"{served.url}/v1/completions",
        json={"model": "keytls", "prompt": [1], "max_tokens": 1},
        verify=str(pki.ca),
        timeout=10,
    )
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{served.url}/health", verify=str(pki.ca), timeout=10).status_code == 200
    assert httpx.get(f"{served.url}/metrics", verify=str(pki.ca), timeout=10).status_code == 200
    with pytest.raises(httpx.HTTPError):  # plain HTTP to the HTTPS port
        httpx.get(served.url.replace("https://", "http://") + "/health", timeout=10)


def test_the_key_is_in_no_log_line(served: Served, pki: Pki) -> None:
    sdk(served, pki, KEY).completions.create(model="keytls", prompt=[3, 4], max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        sdk(served, pki, KEY + "x").completions.create(model="keytls", prompt=[3, 4], max_tokens=2)
    assert KEY not in Path(served.stderr_path).read_text()  # the CLI's and its API servers' stderr
