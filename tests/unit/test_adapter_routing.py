"""Adapter-aware routing: which rank a request for a LoRA adapter goes to, from reports and sends."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raydp.client.adapters import SENT_HOLD_S, AdapterIndex
from raydp.client.balancer import DEFAULT_ADAPTER_LOAD_MARGIN, WAITING_WEIGHT, LoadBalancer
from raydp.errors import ConfigError
from raydp.wire.adapters import AdapterState
from raydp.wire.control import StatsSnapshot


def snapshot(counts: list[tuple[int, int]], adapters: list[AdapterState] | None = None) -> StatsSnapshot:
    return StatsSnapshot(counts=counts, wave=0, running=False, adapters=adapters or [])


def held(*names: str, slots: int = 2) -> AdapterState:
    return AdapterState(list(names), slots)


def test_a_request_goes_to_the_rank_that_holds_its_adapter_though_another_is_idler() -> None:
    lb = LoadBalancer(3)
    lb.on_snapshot(snapshot([(0, 4), (0, 0), (0, 0)], [held("a", "b"), held(), held()]))
    assert lb.choose(adapter="a") == 0, "rank 0 holds it and is within the margin"
    assert lb.choose() == 1, "a base-model request still goes to the least-loaded rank"


def test_a_cold_adapter_stays_on_one_rank_and_is_not_loaded_everywhere() -> None:
    lb = LoadBalancer(4)
    lb.on_snapshot(snapshot([(0, 0)] * 4, [held(slots=2)] * 4))
    ranks = set()
    for _ in range(3):  # a few requests, sent one by one: the first rank's holding it is remembered
        rank = lb.choose(adapter="cold")
        lb.on_sent(rank, 8, "cold")
        lb.on_finished(rank)
        ranks.add(rank)
    assert len(ranks) == 1


def test_a_hot_adapter_spreads_to_one_more_rank_once_its_holder_passes_the_margin() -> None:
    lb = LoadBalancer(3)
    busy = DEFAULT_ADAPTER_LOAD_MARGIN // WAITING_WEIGHT + 1  # waiting requests that put rank 0 past the margin
    lb.on_snapshot(snapshot([(busy, 0), (0, 0), (0, 0)], [held("hot"), held(), held()]))
    first = lb.choose(adapter="hot")
    assert first != 0
    lb.on_sent(first, 8, "hot")
    assert lb.adapters.holds(first, "hot"), "the overflow rank counts as a holder before it reports"
    lb.on_snapshot(snapshot([(busy, 0), (0, 1), (0, 1)], [held("hot"), held(), held()]))
    assert lb.choose(adapter="hot") == first, "the next overflow goes to the rank it spread to, not a third"


def test_with_every_slot_taken_a_new_adapter_evicts_the_least_asked_for_not_a_hot_one() -> None:
    clock = [0.0]
    lb = LoadBalancer(2)
    lb.adapters = AdapterIndex(2, clock=lambda: clock[0])
    for _ in range(5):  # "hot" was asked for five times, "tail" once
        lb.adapters.on_sent(0, "hot")
    lb.adapters.on_sent(1, "tail")
    clock[0] = SENT_HOLD_S + 1  # the sends are no longer taken for holdings: only the reports say who holds what
    # Each rank's least recently used adapter comes first: loading evicts rank 0's "hot" or rank 1's "tail".
    lb.on_snapshot(snapshot([(0, 0), (0, 2)], [held("hot", "b"), held("tail", "c")]))
    assert lb.choose(adapter="new") == 1, "rank 0 is idler, but loading there would evict the hot adapter"
    assert lb.adapters.demand("hot") == pytest.approx(5 * 0.5 ** ((SENT_HOLD_S + 1) / 10.0))


def test_with_no_holder_a_free_slot_beats_evicting_on_a_full_rank() -> None:
    lb = LoadBalancer(2)
    lb.on_snapshot(snapshot([(0, 0), (0, 2)], [held("x", "y"), held("z")]))
    assert lb.choose(adapter="new") == 1, "rank 0 is idler but full: loading there would evict"


def test_with_every_rank_full_the_least_loaded_one_loads_it() -> None:
    lb = LoadBalancer(2)
    lb.on_snapshot(snapshot([(0, 3), (0, 1)], [held("x", "y"), held("z", "w")]))
    assert lb.choose(adapter="new") == 1


def test_a_sent_adapter_is_forgotten_unless_a_report_says_it_was_loaded() -> None:
    now = [0.0]
    lb = LoadBalancer(2)
    lb.adapters = AdapterIndex(2, clock=lambda: now[0])
    lb.on_snapshot(snapshot([(0, 0), (0, 0)], [held(), held()]))
    lb.on_sent(1, 4, "a")
    now[0] = SENT_HOLD_S - 0.1
    lb.on_snapshot(snapshot([(0, 0), (0, 0)], [held(), held()]))
    assert lb.adapters.holds(1, "a")
    now[0] = SENT_HOLD_S
    lb.on_snapshot(snapshot([(0, 0), (0, 0)], [held(), held()]))
    assert not lb.adapters.holds(1, "a")


def test_a_dead_ranks_adapters_are_forgotten() -> None:
    lb = LoadBalancer(2)
    lb.on_snapshot(snapshot([(0, 0), (0, 0)], [held("a"), held()]))
    lb.adapters.forget(0)
    assert not lb.adapters.holds(0, "a")
    assert lb.choose(dead={0}, adapter="a") == 1


def test_prefix_affinity_applies_among_the_adapters_holders() -> None:
    lb = LoadBalancer(4, policy="prefix", prefix_tokens=4)
    lb.on_snapshot(snapshot([(0, 0)] * 4, [held("a"), held(), held("a"), held()]))
    prompts = [[i, i + 1, i + 2, i + 3, 9] for i in range(0, 200, 4)]
    chosen = {lb.choose(prompt=p, adapter="a") for p in prompts}
    assert chosen == {0, 2}, "both holders get prefixes, no other rank does"
    assert all(lb.choose(prompt=p, adapter="a") == lb.choose(prompt=p, adapter="a") for p in prompts)


def test_round_robin_ignores_adapters() -> None:
    lb = LoadBalancer(2, policy="round-robin")
    lb.on_snapshot(snapshot([(0, 0), (0, 0)], [held("a"), held()]))
    assert [lb.choose(adapter="a") for _ in range(4)] == [0, 1, 0, 1]


def test_power_of_two_ignores_adapters() -> None:
    lb = LoadBalancer(2, policy="power-of-two")
    lb.on_snapshot(snapshot([(0, 3), (0, 0)], [held("a"), held()]))
    assert lb.choose(adapter="a") == 1, "the less loaded of its two samples, holder or not"


def test_adapter_affinity_off_is_adapter_blind() -> None:
    lb = LoadBalancer(2, adapter_affinity=False)
    lb.on_snapshot(snapshot([(0, 3), (0, 0)], [held("a"), held()]))
    assert lb.choose(adapter="a") == 1


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [({"adapter_affinity": "yes"}, "adapter_affinity='yes'"), ({"adapter_load_margin": -1}, "adapter_load_margin=-1")],
)
def test_bad_adapter_settings_are_refused_naming_them(kwargs: dict[str, object], said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        LoadBalancer(2, **kwargs)  # type: ignore[arg-type]


def test_a_resize_keeps_the_ranks_that_stay_and_new_ranks_hold_nothing() -> None:
    lb = LoadBalancer(2)
    lb.on_snapshot(snapshot([(0, 0), (0, 0)], [held("a"), held("b")]))
    lb.resize(3, 3)
    assert lb.adapters.holds(0, "a") and lb.adapters.holds(1, "b") and not lb.adapters.holds(2, "a")
    lb.resize(1, 1)
    assert lb.choose(adapter="b") == 0


names = st.sampled_from(["a", "b", "c", "d"])
states = st.builds(held, names, names, slots=st.integers(0, 3))


@given(
    counts=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), min_size=1, max_size=5),
    reports=st.lists(states, max_size=5),
    adapter=names,
    dead=st.sets(st.integers(0, 4), max_size=4),
)
def test_the_choice_is_live_and_a_holder_whenever_one_is_within_the_margin(
    counts: list[tuple[int, int]], reports: list[AdapterState], adapter: str, dead: set[int]
) -> None:
    lb = LoadBalancer(len(counts))
    lb.on_snapshot(snapshot(counts, reports))
    live = [r for r in range(len(counts)) if r not in dead]
    if not live:
        return
    rank = lb.choose(dead=dead, adapter=adapter)
    assert rank in live
    bound = min(lb.running_score(r) for r in live) + lb.adapter_load_margin
    if any(lb.adapters.holds(r, adapter) and lb.running_score(r) <= bound for r in live):
        assert lb.adapters.holds(rank, adapter)
