"""Hybrid and external load-balancing modes, end to end on a 2-node logical-GPU cluster."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import psutil
import pytest

import raydp
from tests.integration.helpers import assert_nothing_left, wait_until
from tests.integration.vllm_helpers import tiny_model

ENGINE = "tests.integration.engines:RankEchoEngine"  # answers with the rank that served


def generate(url: str, **body: Any) -> list[int]:
    payload = json.dumps({"prompt_token_ids": [9], "max_tokens": 1, **body}).encode()
    request = urllib.request.Request(f"{url}/v1/generate", payload, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        return list(json.loads(resp.read())["token_ids"])


def chat(url: str) -> str:
    """A chat completion's answering role (the servers' settings carry the tokenizer and its chat template)."""
    payload = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", payload, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        return str(json.loads(resp.read())["choices"][0]["message"]["role"])


def ranks_by_node(cluster: Any) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for ep in cluster.endpoints.engines:
        out.setdefault(ep.node_id, set()).add(ep.rank)
    return out


def server_pids(url: str) -> list[int]:
    port = int(url.rsplit(":", 1)[1])
    return [c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port and c.pid]


@pytest.mark.timeout(240)
def test_hybrid_servers_on_each_node_route_only_to_that_nodes_ranks(two_nodes: Any) -> None:
    from raydp.serve.settings import ServerSettings

    settings = ServerSettings(tokenizer=str(tiny_model()))  # the same path on both (local) nodes
    with raydp.launch(name="hyb", dp_size=4, dp_size_local=2, engine=ENGINE, progress=False) as cluster:
        nodes = ranks_by_node(cluster)
        assert len(nodes) == 2, nodes  # two ranks on each node
        groups = cluster.serve_api_per_node(2, settings=settings)
        assert sorted(g.node_id for g in groups) == sorted(nodes)
        for group in groups:
            served = {generate(group.url)[0] for _ in range(30)}
            assert served and served <= nodes[group.node_id], (group.url, served, nodes)
            other = next(r for node, ranks in nodes.items() if node != group.node_id for r in ranks)
            assert generate(group.url, rank=other) == [other]  # a pinned rank is still reachable
            assert chat(group.url) == "assistant", "the node's servers have the tokenizer and its chat template"
        assert sorted(s["mode"] for s in _status(cluster)) == ["hybrid", "hybrid"]
        urls = [g.url for g in groups]
    assert_nothing_left("hyb")
    assert all(server_pids(url) == [] for url in urls)


@pytest.mark.timeout(240)
def test_external_mode_gives_every_rank_its_own_endpoint(two_nodes: Any) -> None:
    with raydp.launch(name="ext", dp_size=3, dp_size_local=2, engine=ENGINE, progress=False) as cluster:
        endpoints = cluster.serve_api_per_rank()
        assert [e.ranks for e in endpoints] == [[0], [1], [2]]
        nodes = {ep.rank: ep.node_id for ep in cluster.endpoints.engines}
        for rank, endpoint in enumerate(endpoints):
            assert endpoint.node_id == nodes[rank]
            assert {generate(endpoint.url)[0] for _ in range(10)} == {rank}
            with urllib.request.urlopen(f"{endpoint.url}/health", timeout=10) as resp:
                assert resp.status == 200
        urls = [e.url for e in endpoints]
    assert_nothing_left("ext")
    assert all(server_pids(url) == [] for url in urls)


def _status(cluster: Any) -> list[dict[str, Any]]:
    from raydp.cli.status import describe_cluster

    return list(describe_cluster(cluster.name)["api_servers"])


@pytest.mark.timeout(120)
def test_external_mode_and_server_settings_on_the_mp_backend() -> None:
    from raydp.serve.settings import ServerSettings

    tokenizer = ServerSettings(tokenizer=str(tiny_model()))
    with raydp.launch(name="extmp", dp_size=2, engine=ENGINE, backend="mp", progress=False) as cluster:
        endpoints = cluster.serve_api_per_rank(settings=tokenizer)
        assert [e.url.startswith("http://127.0.0.1:") for e in endpoints] == [True, True]
        for rank, endpoint in enumerate(endpoints):
            assert {generate(endpoint.url)[0] for _ in range(5)} == {rank}
            assert chat(endpoint.url) == "assistant"
        small = cluster.serve_api(1, settings=ServerSettings(max_body_bytes=1000))
        with pytest.raises(urllib.error.HTTPError) as too_big:
            generate(small.url, prompt_token_ids=[1] * 1000)
        assert too_big.value.code == 413
        assert generate(small.url) in ([0], [1])  # a small body still goes through
        urls = [e.url for e in endpoints] + [small.url]
    assert all(server_pids(url) == [] for url in urls)


@pytest.mark.timeout(120)
def test_a_request_goes_to_the_rank_with_less_work_when_counts_are_even(two_nodes: Any) -> None:
    """One request runs on each rank, a long one and a short one: by count they are even, by work not."""
    kwargs = {"max_running": 1, "step_delay_s": 0.01}
    with raydp.launch(name="work", dp_size=2, engine_kwargs=kwargs, progress=False) as cluster:
        client = cluster.client()
        long, short = client.submit([1], 100_000, rank=0), client.submit([2], 500, rank=1)

        def both_seen() -> bool:
            snap = client.snapshot()
            return snap is not None and len(snap.work) == 2 and snap.work[0] > snap.work[1] > 0

        assert wait_until(both_seen, timeout=30), client.snapshot()
        snap = client.snapshot()
        assert snap is not None and snap.counts == [(0, 1), (0, 1)], snap
        chosen = client.submit([3], 1)
        assert chosen.result(timeout=30) == [3]
        assert chosen.rank == 1, "sent behind the long request, though the short one ends sooner"
        for handle in (long, short):
            client.abort(handle.request_id)
