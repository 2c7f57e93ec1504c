"""The ``prefix`` policy: cache affinity by rendezvous hashing of a prompt's prefix, bounded by load."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raydp.client.balancer import WAITING_WEIGHT, LoadBalancer
from raydp.client.prefix import preference, prefix_key
from raydp.errors import ConfigError
from raydp.wire.control import StatsSnapshot

prompts = st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=200)


def balancer(ranks: int = 4, client_index_count: int = 1, margin: int = 16) -> LoadBalancer:
    lb = LoadBalancer(ranks, client_index_count, policy="prefix", prefix_load_margin=margin)
    lb.on_snapshot(StatsSnapshot(counts=[(0, 0)] * ranks, wave=0, running=False))
    return lb


@settings(max_examples=200, deadline=None)
@given(prompt=prompts, suffix_a=prompts, suffix_b=prompts)
def test_prompts_sharing_the_prefix_go_to_one_rank_in_every_client_process(
    prompt: list[int], suffix_a: list[int], suffix_b: list[int]
) -> None:
    head = (prompt * 64)[:64]  # a full prefix key's worth
    one, other = balancer(client_index_count=2), balancer(client_index_count=2)  # two API servers
    assert one.choose((), head + suffix_a) == other.choose((), head + suffix_b) == one.choose((), head)


@settings(max_examples=200, deadline=None)
@given(prompt=prompts, dead=st.sets(st.integers(0, 5), max_size=5))
def test_a_dead_rank_moves_only_the_prefixes_that_preferred_it(prompt: list[int], dead: set[int]) -> None:
    lb = balancer(6)
    before = lb.choose((), prompt)
    after = lb.choose(dead, prompt)
    assert after not in dead
    if before not in dead:
        assert after == before, "a prefix whose rank lives stays where its cache is"
    else:
        assert after == next(r for r in preference(prefix_key(prompt), range(6)) if r not in dead)


@settings(max_examples=200, deadline=None)
@given(prompt=prompts, scores=st.lists(st.integers(0, 40), min_size=4, max_size=4), margin=st.integers(0, 24))
def test_the_choice_is_never_busier_than_the_least_loaded_by_more_than_the_margin(
    prompt: list[int], scores: list[int], margin: int
) -> None:
    lb = LoadBalancer(4, policy="prefix", prefix_load_margin=margin)
    lb.on_snapshot(StatsSnapshot(counts=[(0, s) for s in scores], wave=0, running=False))
    chosen = lb.choose((), prompt)
    assert lb.score(chosen) <= min(scores) + margin
    preferred = [r for r in preference(prefix_key(prompt), range(4)) if scores[r] <= min(scores) + margin]
    assert chosen == preferred[0], "the most preferred rank within the margin"


def test_a_hot_prefix_overflows_to_its_next_rank_once_its_queue_passes_the_margin() -> None:
    lb = balancer(4, margin=2 * WAITING_WEIGHT)
    hot = list(range(100))
    first, second = preference(prefix_key(hot), range(4))[:2]
    picks = []
    for _ in range(12):  # a burst before any snapshot: our own sends are the load
        rank = lb.choose((), hot)
        lb.on_sent(rank)
        picks.append(rank)
    assert picks[:3] == [first] * 3, "affinity while within the margin"
    assert set(picks) > {first} and picks[3] == second, "then the next preferred rank, not a random one"


def test_distinct_prefixes_spread_over_the_ranks() -> None:
    rng = random.Random(7)
    lb = balancer(4)
    shares = Counter(lb.choose((), [rng.randrange(50_000) for _ in range(80)]) for _ in range(4000))
    assert all(800 <= shares[r] <= 1200 for r in range(4)), shares


def test_no_prompt_means_least_loaded_and_bad_settings_name_the_field() -> None:
    lb = LoadBalancer(3, policy="prefix")
    lb.on_snapshot(StatsSnapshot(counts=[(1, 0), (0, 0), (2, 0)], wave=0, running=False))
    assert lb.choose((), None) == 1
    with pytest.raises(ConfigError, match="prefix_tokens=0"):
        LoadBalancer(2, policy="prefix", prefix_tokens=0)
    with pytest.raises(ConfigError, match="prefix_load_margin=-1"):
        LoadBalancer(2, policy="prefix", prefix_load_margin=-1)
