"""The LoRA benchmark's bound: Belady's count is exact on small cases and no routing beats it."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.vllm_dp.lora_bound import (
    adapter_aware,
    clairvoyant_loads,
    least_loaded,
    pooled_lru_loads,
    pooled_popular_loads,
    routed_loads,
)

pytestmark = pytest.mark.timeout(60)


def test_the_clairvoyant_count_evicts_what_is_needed_last() -> None:
    # Two slots: a, b load; c evicts b (asked for later than a), a hits, b reloads evicting c (never again).
    assert clairvoyant_loads(list("abcab"), 2) == 4
    assert clairvoyant_loads(list("abab"), 2) == 2
    assert clairvoyant_loads(list("abcabc"), 3) == 3


@given(st.lists(st.sampled_from("abcdefgh"), max_size=60), st.integers(0, 3))
def test_no_routing_over_two_ranks_of_two_slots_loads_fewer_than_the_bound(sequence: list[str], seed: int) -> None:
    bound = clairvoyant_loads(sequence, 4)
    assert bound <= routed_loads(sequence, adapter_aware, seed)
    assert bound <= routed_loads(sequence, least_loaded, seed)
    assert bound <= pooled_lru_loads(sequence, 4)
    assert bound <= pooled_popular_loads(sequence, 4)
    assert bound >= len(set(sequence)), "each adapter asked for loads at least once"


def test_adapter_aware_routing_keeps_a_hot_adapter_where_it_is() -> None:
    sequence = random.Random(0).choices("aaaaab", k=200)
    assert routed_loads(sequence, adapter_aware, 0) == 2, "a and b each load once: 4 slots hold both"


def test_the_pooled_caches_count_their_own_evictions() -> None:
    # LRU of 2: a, b load; c evicts a; a evicts b; b evicts c.
    assert pooled_lru_loads(list("abcab"), 2) == 5
    # Popularity known, 2 slots: a (asked for most) is pinned and loads once; b, c, b share the other slot.
    assert pooled_popular_loads(list("abacaba"), 2) == 4
    assert pooled_popular_loads([], 4) == 0
