"""Adapter-aware routing on a running cluster: DP=3 echo engines with 2 LoRA adapter slots each (mp backend).

The engines hold adapter names, not weights (:mod:`raydp.models.adapter_slots`),
and report them as vLLM engines do; what a user sees is which rank answered
each request (``handle.rank``) and what each rank reports holding.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import pytest

import raydp
from raydp.wire.adapters import AdapterState
from tests.integration.helpers import wait_until

pytestmark = pytest.mark.timeout(180)
ADAPTERS = [f"ad{i}" for i in range(6)]  # as many as the cluster's slots: 3 ranks x 2


@pytest.fixture(scope="module")
def cluster() -> Iterator[raydp.Cluster]:
    kwargs = {"max_loras": 2, "adapter_load_s": 0.02, "step_delay_s": 0.005}
    with raydp.launch(
        name="adapters", dp_size=3, backend="mp", max_restarts=0, progress=False, engine_kwargs=kwargs
    ) as launched:
        yield launched


def reports(client: raydp.Client) -> list[AdapterState]:
    snap = client.snapshot()
    return list(snap.adapters) if snap is not None else []


def loads(client: raydp.Client) -> int:
    return sum(state.loads for state in reports(client))


def serve_in_turn(client: raydp.Client, rounds: int, adapters: list[str] = ADAPTERS) -> dict[str, set[int]]:
    """Each adapter in turn, one request at a time; the ranks that served each adapter."""
    served: dict[str, set[int]] = defaultdict(set)
    for _ in range(rounds):
        for adapter in adapters:
            handle = client.submit([1, 2, 3], 4, adapter=adapter)
            assert handle.result(30) == [1, 2, 3, 1]
            assert handle.rank is not None
            served[adapter].add(handle.rank)
    return served


def test_each_adapter_stays_on_one_rank_and_nothing_is_loaded_twice(cluster: raydp.Cluster) -> None:
    client = cluster.client()
    served = serve_in_turn(client, rounds=4)
    assert all(len(ranks) == 1 for ranks in served.values()), dict(served)
    assert wait_until(lambda: loads(client) == len(ADAPTERS), timeout=10), reports(client)
    held = [adapter for state in reports(client) for adapter in state.resident]
    assert sorted(held) == ADAPTERS, "each adapter is held once, on the rank that serves it"
    assert sum(state.evictions for state in reports(client)) == 0


def test_adapter_blind_routing_swaps_adapters_in_and_out(cluster: raydp.Cluster) -> None:
    """Requests from an adapter-blind client load adapters again and again (the comparison): four adapters
    in turn, so that no rotation over the 3 ranks keeps meeting each one where it is held."""
    aware = cluster.client()
    before = loads(aware)
    serve_in_turn(cluster.client(adapter_affinity=False), rounds=3, adapters=ADAPTERS[:4])
    assert wait_until(lambda: loads(aware) > before + 3, timeout=10), reports(aware)  # aware: 0 in 24


def test_a_hot_adapter_spreads_past_its_first_rank(cluster: raydp.Cluster) -> None:
    """A burst for one adapter overflows its first rank's margin and loads it on more ranks (a cold one,
    asked for one request at a time, stays on one: the first test)."""
    client = cluster.client()
    hot = client.submit_many([[5, 6]] * 90, 40, adapter="hot")
    assert all(len(h.result(60)) == 40 for h in hot)
    assert len({h.rank for h in hot}) >= 2
    assert wait_until(lambda: sum("hot" in state.resident for state in reports(client)) >= 2, timeout=10)


def test_an_engine_without_adapter_slots_fails_the_request_naming_why() -> None:
    with (
        raydp.launch(name="noslots", dp_size=1, backend="mp", progress=False) as plain,
        pytest.raises(raydp.RequestError, match="max_loras"),
    ):
        plain.client().generate([1], 2, adapter="ad0", timeout=30)


def test_a_bad_adapter_name_is_refused_before_anything_is_sent(cluster: raydp.Cluster) -> None:
    with pytest.raises(raydp.ConfigError, match="adapter="):
        cluster.client().submit([1], 2, adapter="x" * 300)
