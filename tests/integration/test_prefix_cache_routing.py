"""``balancer="prefix"`` on what the engines' caches hold: 2 API server processes, DP=2 (mp backend).

The echo engines keep a prefix cache (``prefix_cache_blocks``) and report it
through ``cache_events()``, as vLLM engines do. A rank that holds a prompt's
prefix gets the prompt from both API servers even where the prefix hash
names the other rank, each server's ``/metrics`` shows the ranks' hit rates,
and once the holder dies its prefixes go to the live rank.
"""

from __future__ import annotations

import http.client
import random
import time
from collections.abc import Iterator
from typing import Any

import pytest

import raydp
from raydp.client.prefix import preference, prefix_key
from raydp.serve.settings import ServerSettings
from tests.integration.test_prefix_routing import complete, connections_to_each_server, kill_rank

pytestmark = pytest.mark.timeout(180)
BLOCK = 16
Conns = dict[int, http.client.HTTPConnection]


def prompt_preferring(rank: int, salt: int) -> list[int]:
    """A 96-token prompt, different for each ``salt``, whose prefix hash names ``rank`` first of two."""
    rng = random.Random(salt)
    while True:
        prompt = [rng.randrange(1, 50_000) for _ in range(96)]
        if preference(prefix_key(prompt), range(2))[0] == rank:
            return prompt


@pytest.fixture(scope="module")
def cluster() -> Iterator[raydp.Cluster]:
    with raydp.launch(
        name="prefix-cache",
        dp_size=2,
        backend="mp",
        max_restarts=0,
        progress=False,
        engine_kwargs={"step_delay_s": 0.005, "prefix_cache_blocks": 512, "block_size": BLOCK},
    ) as launched:
        yield launched


def per_rank(conn: http.client.HTTPConnection, metric: str) -> dict[int, float]:
    """``metric``'s value per rank on the API server process behind ``conn``."""
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith(metric + "{"):
            rank = int(line.split('rank="', 1)[1].split('"', 1)[0])
            values[rank] = float(line.rsplit(" ", 1)[1])
    return values


def wait_for(conns: Conns, metric: str, ok: Any, timeout: float = 30.0) -> None:
    """Until ``ok(values per rank)`` holds on every API server process (bounded in time)."""
    deadline = time.monotonic() + timeout
    seen: dict[int, dict[int, float]] = {}
    while time.monotonic() < deadline:
        seen = {index: per_rank(conn, metric) for index, conn in conns.items()}
        if all(ok(values) for values in seen.values()):
            return
        time.sleep(0.05)
    raise AssertionError(f"{metric} per API server never became as expected: {seen}")


def cache_on(cluster: raydp.Cluster, conns: Conns, prompt: list[int], rank: int) -> None:
    """Serve ``prompt`` on ``rank`` (its cache stores the prompt's blocks) and wait until every API
    server's picture of the rank has as many blocks as the engine's cache."""
    client = cluster.client()
    assert client.generate(prompt, max_tokens=1, rank=rank)
    held = client.call_utility(rank, "stats")["cached_blocks"]
    wait_for(conns, "raydp_router_cached_blocks", lambda blocks: blocks.get(rank) == held)


def test_a_prefix_goes_where_an_engine_cached_it_from_both_api_servers(cluster: raydp.Cluster) -> None:
    servers = cluster.serve_api(2, port=0, settings=ServerSettings(balancer="prefix"))
    try:
        conns = connections_to_each_server(servers.address)
        warm, cold = prompt_preferring(0, 1), prompt_preferring(0, 2)  # the hash names rank 0 for both
        cache_on(cluster, conns, [*warm, 1], rank=1)  # rank 1's cache holds warm, and both servers know it
        for turn in range(4):
            for index, conn in conns.items():
                assert complete(conn, [*warm, 100 + turn, index])["rank"] == 1, (turn, index)
                assert complete(conn, [*cold, 100 + turn, index])["rank"] == 0, (turn, index)
        # Rank 1 found the 96 cached tokens of warm in 8 of its 9 lookups; rank 0 missed once for cold.
        wait_for(
            conns,
            "raydp_rank_prefix_cache_hit_rate",
            lambda rates: rates.get(1, 0) > 0.75 and 0.75 < rates.get(0, 0) < 0.95,
        )
    finally:
        servers.close()


def test_once_the_holder_dies_its_prefixes_go_to_the_live_rank(cluster: raydp.Cluster) -> None:
    servers = cluster.serve_api(2, port=0, settings=ServerSettings(balancer="prefix"))
    try:
        conns = connections_to_each_server(servers.address)
        held = prompt_preferring(0, 3)
        cache_on(cluster, conns, [*held, 1], rank=1)
        assert {complete(conn, [*held, 2])["rank"] for conn in conns.values()} == {1}
        kill_rank(cluster, 1)
        fresh = connections_to_each_server(servers.address)
        for conn in fresh.values():
            assert {complete(conn, [*held, turn])["rank"] for turn in range(3)} == {0}
    finally:
        servers.close()
