"""A request's end when its HTTP client hangs up, its time runs out or its rank dies.

What happened on the engine is read from the engine loop's own counters
(``raydp_counters``: requests added, finished, aborted), through a client
of the same cluster: an in-process mp cluster whose echo engine sleeps 20 ms a
step, so a long request is still running when the test acts.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import raydp
from raydp.client.client import Client
from raydp.serve.processes import APIServerProcessManager
from raydp.serve.settings import ServerSettings
from tests.integration.http_helpers import call, read_until_closed

LONG = 100_000  # tokens: minutes at 20 ms a step, so only an abort ends it


@dataclass
class Slow:
    cluster: raydp.Cluster
    servers: APIServerProcessManager
    client: Client  # of the cluster, to read the engines' counters

    def kill_rank(self, rank: int) -> None:
        procs = self.cluster._manager.procs  # type: ignore[union-attr]
        os.kill(next(p for p in procs if p.rank == rank).process.pid, signal.SIGKILL)


@contextmanager
def slow_cluster(name: str, api_servers: int, **settings: Any) -> Iterator[Slow]:
    with raydp.launch(
        name=name, dp_size=2, backend="mp", progress=False, engine_kwargs={"step_delay_s": 0.02}
    ) as cluster:
        servers = APIServerProcessManager(cluster.endpoints, api_servers, settings=ServerSettings(**settings))
        try:
            yield Slow(cluster, servers, cluster.client())
        finally:
            servers.close()


def counters(client: Client, rank: int) -> dict[str, int]:
    return dict(client.call_utility(rank, "raydp_counters", timeout=10))


def settles_at(client: Client, rank: int, expected: dict[str, int], timeout: float = 15) -> dict[str, int]:
    """The rank's counters once they equal ``expected`` (or the last ones seen, after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while (seen := counters(client, rank)) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return seen


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=30)


@pytest.mark.timeout(120)
def test_hanging_up_mid_stream_aborts_the_request_on_its_engine() -> None:
    with slow_cluster("hangup", api_servers=4) as slow:
        stream = sdk(slow.servers.url).completions.create(
            model="hangup", prompt=[3], max_tokens=LONG, stream=True, extra_body={"rank": 0}
        )
        got: list[int] = []
        for chunk in stream:
            got += (chunk.choices[0].model_extra or {})["token_ids"]
            if len(got) >= 3:
                break
        stream.close()  # the HTTP client hangs up
        assert got[:3] == [3, 3, 3]
        assert settles_at(slow.client, 0, {"added": 1, "finished": 0, "aborted": 1}) == {
            "added": 1,
            "finished": 0,
            "aborted": 1,
        }, "the engine dropped the request"
        assert counters(slow.client, 1) == {"added": 0, "finished": 0, "aborted": 0}
        done = sdk(slow.servers.url).completions.create(
            model="hangup", prompt=[5], max_tokens=2, extra_body={"rank": 0}
        )
        assert done.choices[0].text == "\x05\x05", "the rank serves on"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/generate"])
def test_hanging_up_before_the_answer_aborts_the_request_too(path: str) -> None:
    body = {"prompt": [4], "max_tokens": LONG, "rank": 1}
    if path == "/v1/generate":
        body = {"prompt_token_ids": [4], "max_tokens": LONG, "rank": 1}
    with slow_cluster("waithangup", api_servers=2) as slow:
        payload = json.dumps(body).encode()
        sock = socket.create_connection(slow.servers.address)
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        assert settles_at(slow.client, 1, {"added": 1, "finished": 0, "aborted": 0})["added"] == 1
        sock.close()
        assert settles_at(slow.client, 1, {"added": 1, "finished": 0, "aborted": 1}) == {
            "added": 1,
            "finished": 0,
            "aborted": 1,
        }


@pytest.mark.timeout(120)
def test_a_request_past_request_timeout_gets_504_and_is_aborted() -> None:
    with slow_cluster("timeout", api_servers=1, request_timeout_s=1.0) as slow:
        start = time.monotonic()
        answer = call(slow.servers.address, "POST", "/v1/completions", {"prompt": [1], "max_tokens": LONG, "rank": 0})
        assert answer.status == 504 and 0.9 < time.monotonic() - start < 30
        assert answer.json() == {
            "error": {
                "message": "the request ran past request_timeout_s=1",
                "type": "timeout",
                "param": None,
                "code": "timeout",
            }
        }
        # A stream has answered 200 by then: the timeout comes as an error event, which the SDK raises.
        stream = sdk(slow.servers.url).completions.create(
            model="timeout", prompt=[2], max_tokens=LONG, stream=True, extra_body={"rank": 0}
        )
        with pytest.raises(openai.APIError, match="ran past request_timeout_s=1"):
            for _ in stream:
                pass
        assert settles_at(slow.client, 0, {"added": 2, "finished": 0, "aborted": 2}) == {
            "added": 2,
            "finished": 0,
            "aborted": 2,
        }, "both were dropped on the engine"


def metric(url_address: tuple[str, int], name: str, labels: dict[str, str]) -> float | None:
    text = call(url_address, "GET", "/metrics").body.decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None


@pytest.mark.timeout(120)
def test_a_dead_rank_is_a_503_and_shows_in_the_metrics() -> None:
    with slow_cluster("deadrank", api_servers=1) as slow:
        stream = sdk(slow.servers.url).completions.create(
            model="deadrank", prompt=[8], max_tokens=LONG, stream=True, extra_body={"rank": 1}
        )
        assert next(iter(stream)).choices[0].text == "\x08"
        slow.kill_rank(1)
        with pytest.raises(openai.APIError, match="rank 1"):
            for _ in stream:  # mid-stream: an error event ends it
                pass
        pinned = call(slow.servers.address, "POST", "/v1/completions", {"prompt": [1], "max_tokens": 2, "rank": 1})
        assert pinned.status == 503
        error = pinned.json()["error"]
        assert error["type"] == "service_unavailable" and "rank 1" in error["message"]
        for _ in range(4):  # the live rank takes the rest
            ok = call(slow.servers.address, "POST", "/v1/completions", {"prompt": [1], "max_tokens": 2})
            assert ok.status == 200 and ok.json()["choices"][0]["rank"] == 0
        deadline = time.monotonic() + 10
        while metric(slow.servers.address, "raydp_rank_dead", {"rank": "1"}) != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(slow.servers.address, "raydp_rank_dead", {"rank": "1"}) == 1
        assert metric(slow.servers.address, "raydp_rank_dead", {"rank": "0"}) == 0
        assert metric(slow.servers.address, "raydp_rank_deaths_total", {"rank": "1"}) == 1
        slow.kill_rank(0)
        deadline = time.monotonic() + 10
        while metric(slow.servers.address, "raydp_rank_dead", {"rank": "0"}) != 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        every = call(slow.servers.address, "POST", "/v1/completions", {"prompt": [1], "max_tokens": 2})
        assert every.status == 503 and every.json()["error"]["type"] == "service_unavailable"
        assert call(slow.servers.address, "GET", "/health").status == 200, "the API server itself lives on"


@pytest.mark.timeout(60)
def test_an_oversized_body_to_a_live_cluster_closes_only_that_connection() -> None:
    with slow_cluster("bigbody", api_servers=1, max_body_bytes=1000) as slow:
        sock = socket.create_connection(slow.servers.address)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n")
        data, closed_after = read_until_closed(sock, timeout=10)
        assert data.startswith(b"HTTP/1.1 413 ") and b"connection: close" in data.lower()
        assert b'"code":"request_too_large"' in data and closed_after is not None
        assert counters(slow.client, 0)["added"] + counters(slow.client, 1)["added"] == 0, "nothing reached an engine"
