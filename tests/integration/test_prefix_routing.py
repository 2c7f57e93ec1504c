"""``balancer="prefix"`` over HTTP: 2 API server processes, DP=2 of the echo engine (mp backend).

Each API server's client computes a prompt prefix's rank by itself
(rendezvous hashing); these tests check what a user would see: the rank that
answered (``choices[0].rank``) for requests sent through each of the two
processes, under a hot prefix, and after the preferred rank dies.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

import raydp
from raydp.client.prefix import preference, prefix_key
from raydp.serve.settings import ServerSettings

pytestmark = pytest.mark.timeout(180)
SYSTEM = [(7 * i + 3) % 251 + 1 for i in range(96)]  # a shared "system prompt" of 96 token ids


@pytest.fixture(scope="module")
def cluster() -> Iterator[raydp.Cluster]:
    with raydp.launch(
        name="prefix", dp_size=2, backend="mp", max_restarts=0, progress=False, engine_kwargs={"step_delay_s": 0.01}
    ) as launched:
        yield launched


def connections_to_each_server(address: tuple[str, int]) -> dict[int, http.client.HTTPConnection]:
    """A kept-alive connection to each API server process.

    The processes share one listening socket and the kernel hands a new connection to whichever
    accepts first: one process that has just started, or is busy, may get none for a while. So
    connections are opened 8 at a time, from threads, until both have answered (bounded in time).
    """
    found: dict[int, http.client.HTTPConnection] = {}
    lock = threading.Lock()

    def one() -> None:
        conn = http.client.HTTPConnection(*address, timeout=30)
        conn.request("GET", "/health")
        index = json.loads(conn.getresponse().read())["client_index"]
        with lock:
            if index in found:
                conn.close()
            else:
                found[index] = conn

    deadline = time.monotonic() + 60
    while len(found) < 2 and time.monotonic() < deadline:
        batch = [threading.Thread(target=one) for _ in range(8)]
        for t in batch:
            t.start()
        for t in batch:
            t.join(timeout=30)
        if len(found) < 2:
            time.sleep(0.1)
    assert len(found) == 2, f"reached only API servers {sorted(found)} in 60 s"
    return found


def kill_rank(cluster: raydp.Cluster, rank: int) -> None:
    """SIGKILL rank ``rank``'s engine process (mp backend)."""
    procs = cluster._manager.procs  # type: ignore[attr-defined]
    os.kill(next(p for p in procs if p.rank == rank).process.pid, signal.SIGKILL)


def complete(conn: http.client.HTTPConnection, prompt: list[int], max_tokens: int = 4) -> dict[str, Any]:
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps({"prompt": prompt, "max_tokens": max_tokens}),
        {"Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    body = json.loads(resp.read())
    assert resp.status == 200, body
    return dict(body["choices"][0])


def test_a_shared_prefix_lands_on_one_rank_from_both_api_servers(cluster: raydp.Cluster) -> None:
    servers = cluster.serve_api(2, port=0, settings=ServerSettings(balancer="prefix"))
    try:
        conns = connections_to_each_server(servers.address)
        ranks = {
            (index, turn): complete(conn, [*SYSTEM, 1000 + turn, index])["rank"]
            for index, conn in conns.items()
            for turn in range(6)
        }
        want = preference(prefix_key(SYSTEM), range(2))[0]
        assert set(ranks.values()) == {want}, ranks
        other = next(
            p for p in ([k + 1] * 96 for k in range(50)) if preference(prefix_key(p), range(2))[0] != want
        )  # a prefix that prefers the other rank
        assert {complete(conn, [*other, 5])["rank"] for conn in conns.values()} == {1 - want}
    finally:
        servers.close()


def test_a_hot_prefix_is_spread_by_the_load_margin(cluster: raydp.Cluster) -> None:
    """80% of the requests share one prefix; affinity alone would put them all on one rank. With a
    margin of 2 (two running requests), each rank serves 30% to 70% of them."""
    servers = cluster.serve_api(2, port=0, settings=ServerSettings(balancer="prefix", prefix_load_margin=2))
    ranks: Counter[int] = Counter()
    lock = threading.Lock()

    def send(worker: int) -> None:
        conn = http.client.HTTPConnection(*servers.address, timeout=60)
        for i in range(10):
            prompt = [*SYSTEM, worker, i] if (worker * 10 + i) % 5 else [worker + 300, i, *SYSTEM]
            rank = complete(conn, prompt, max_tokens=20)["rank"]
            with lock:
                ranks[rank] += 1
        conn.close()

    try:
        threads = [threading.Thread(target=send, args=(w,)) for w in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert sum(ranks.values()) == 160
        assert 0.3 * 160 <= ranks[0] <= 0.7 * 160, ranks
    finally:
        servers.close()


def test_after_the_preferred_rank_dies_its_prefixes_go_to_the_live_rank(cluster: raydp.Cluster) -> None:
    servers = cluster.serve_api(2, port=0, settings=ServerSettings(balancer="prefix"))
    try:
        conns = connections_to_each_server(servers.address)
        want = preference(prefix_key(SYSTEM), range(2))[0]
        assert {complete(conn, [*SYSTEM, 1])["rank"] for conn in conns.values()} == {want}
        kill_rank(cluster, want)
        fresh = connections_to_each_server(servers.address)
        for conn in fresh.values():
            answers = [complete(conn, [*SYSTEM, turn]) for turn in range(4)]
            assert {a["rank"] for a in answers} == {1 - want}, answers
    finally:
        servers.close()
