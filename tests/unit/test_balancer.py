"""The load balancer's choice: snapshot load plus what this client sent since."""

from __future__ import annotations

import pytest

from raydp.client.balancer import WAITING_WEIGHT, LoadBalancer
from raydp.errors import ConfigError
from raydp.wire.control import StatsSnapshot


def test_least_loaded_rank_wins_by_waiting_weight() -> None:
    lb = LoadBalancer(3)
    lb.on_snapshot(StatsSnapshot(counts=[(1, 0), (0, 3), (0, 5)], wave=0, running=False))
    assert lb.choose() == 1  # 4*1+0=4 > 0*4+3=3


def test_sends_since_the_snapshot_count_so_a_burst_spreads() -> None:
    lb = LoadBalancer(2)
    lb.on_snapshot(StatsSnapshot(counts=[(0, 0), (0, 0)], wave=0, running=False))
    picks = []
    for _ in range(6):
        rank = lb.choose()
        lb.on_sent(rank)
        picks.append(rank)
    assert picks.count(0) == picks.count(1) == 3


def test_a_send_still_counts_after_it_finishes_until_the_next_snapshot() -> None:
    """The snapshot cannot know of our send yet; in-flight bookkeeping is only a tie-break."""
    lb = LoadBalancer(2)
    lb.on_snapshot(StatsSnapshot(counts=[(0, 0), (0, 3)], wave=0, running=False))
    lb.on_sent(0)
    lb.on_finished(0)
    assert lb.score(0) == WAITING_WEIGHT
    assert lb.choose() == 1  # 4 (our send) > 3 (snapshot)


def test_the_running_score_counts_only_the_sends_still_running() -> None:
    """What the prefix margin compares: a send that finished before the next snapshot weighs nothing."""
    lb = LoadBalancer(2)
    lb.on_snapshot(StatsSnapshot(counts=[(0, 0), (0, 3)], wave=0, running=False))
    lb.on_sent(0)
    assert lb.running_score(0) == WAITING_WEIGHT
    lb.on_finished(0)
    assert (lb.running_score(0), lb.score(0)) == (0, WAITING_WEIGHT)


def test_sequential_requests_keep_a_prefix_on_one_rank_between_snapshots() -> None:
    """One request at a time, no snapshot in between: no load, so no margin can move a prefix."""
    lb = LoadBalancer(2, policy="prefix", prefix_load_margin=8)
    lb.on_snapshot(StatsSnapshot(counts=[(0, 0), (0, 0)], wave=0, running=False))
    prefixes = [[7] * 300, [9] * 300]
    picks: dict[int, set[int]] = {0: set(), 1: set()}
    for i in range(24):
        rank = lb.choose(prompt=prefixes[i % 2])
        picks[i % 2].add(rank)
        lb.on_sent(rank, 16)
        lb.on_finished(rank)
    assert all(len(ranks) == 1 for ranks in picks.values()), picks


def test_the_running_score_keeps_the_bookings_of_requests_still_in_flight() -> None:
    lb = LoadBalancer(2, client_count=2)
    for _ in range(3):
        lb.on_sent(0)
    lb.on_finished(0)
    assert lb.running_score(0) == WAITING_WEIGHT * 2 * 2  # two of ours still running, each booked for both
    assert lb.score(0) == WAITING_WEIGHT * 3 * 2


def test_a_new_snapshot_replaces_local_estimates() -> None:
    lb = LoadBalancer(2)
    for _ in range(5):
        lb.on_sent(0)
    assert lb.choose() == 1
    lb.on_snapshot(StatsSnapshot(counts=[(0, 0), (2, 0)], wave=3, running=True))
    assert lb.choose() == 0
    assert (lb.wave, lb.running) == (3, True)


def test_client_count_scales_local_sends() -> None:
    solo, shared = LoadBalancer(2, client_count=1), LoadBalancer(2, client_count=4)
    solo.on_sent(0)
    shared.on_sent(0)
    assert solo.score(0) == WAITING_WEIGHT, "one send counts as one waiting request"
    assert shared.score(0) == 4 * WAITING_WEIGHT, "each of 4 API servers may have sent one too"


def test_dead_ranks_are_skipped_and_all_dead_is_an_error() -> None:
    lb = LoadBalancer(3)
    assert lb.choose(dead={0}) == 1
    with pytest.raises(ConfigError, match="every rank this client may use is dead"):
        lb.choose(dead={0, 1, 2})


def test_ties_go_to_fewest_in_flight_then_lowest_rank() -> None:
    lb = LoadBalancer(3)
    lb.on_sent(0)
    lb.on_snapshot(StatsSnapshot(counts=[(0, 0)] * 3, wave=0, running=False))
    assert lb.choose() == 1
    lb.on_finished(0)
    assert lb.choose() == 0


def test_first_request_of_a_paused_cluster_is_noted_once() -> None:
    lb = LoadBalancer(2)
    assert lb.note_first_request() is True
    assert lb.note_first_request() is False
    lb.on_snapshot(StatsSnapshot(counts=[(0, 0)] * 2, wave=1, running=False))
    assert lb.note_first_request() is True


@pytest.mark.parametrize("kwargs", [{"engine_count": 0}, {"engine_count": 2, "client_count": 0}])
def test_bad_sizes_name_the_field(kwargs: dict[str, int]) -> None:
    with pytest.raises(ConfigError, match=next(iter(k for k in kwargs if kwargs[k] < 1))):
        LoadBalancer(**kwargs)


def test_eligible_ranks_restrict_the_choice_to_a_nodes_own_ranks() -> None:
    lb = LoadBalancer(4, eligible=[2, 3])
    lb.on_snapshot(StatsSnapshot(counts=[(0, 0), (0, 0), (5, 0), (9, 0)], wave=0, running=False))
    assert lb.choose() == 2  # ranks 0 and 1 are idle, but not this front-end's
    assert lb.choose(dead={2}) == 3
    with pytest.raises(ConfigError, match="every rank this client may use is dead"):
        lb.choose(dead={2, 3})


@pytest.mark.parametrize("eligible", [[], [4], [-1], [0, 9]])
def test_eligible_ranks_outside_the_cluster_are_refused(eligible: list[int]) -> None:
    with pytest.raises(ConfigError, match="ranks="):
        LoadBalancer(4, eligible=eligible)


def _loaded(policy: str, scores: list[int]) -> LoadBalancer:
    balancer = LoadBalancer(len(scores), policy=policy)  # type: ignore[arg-type]
    balancer.on_snapshot(StatsSnapshot(counts=[(0, s) for s in scores], wave=0, running=False))
    return balancer


def test_round_robin_cycles_over_the_live_ranks_whatever_their_load() -> None:
    balancer = _loaded("round-robin", [9, 0, 0])
    assert [balancer.choose() for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    assert {balancer.choose(dead={1}) for _ in range(4)} == {0, 2}


def test_power_of_two_never_picks_the_busiest_rank_and_favours_the_idlest() -> None:
    balancer = _loaded("power-of-two", [0, 5, 10])
    picks = [balancer.choose() for _ in range(600)]
    assert 2 not in picks, "the busiest rank always loses its comparison"
    assert 300 < picks.count(0) < 500, "the idlest wins the 2 of 3 pairs it is in"


def test_an_unknown_policy_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="policy='random': must be one of least-loaded, power-of-two, round-robin"):
        LoadBalancer(2, policy="random")  # type: ignore[arg-type]


def test_with_even_counts_the_rank_with_the_least_work_wins() -> None:
    """Two long requests running look like two short ones by count; by work they differ."""
    lb = LoadBalancer(3)
    lb.on_snapshot(StatsSnapshot(counts=[(0, 2), (0, 2), (0, 2)], wave=0, running=False, work=[120, 8, 70]))
    assert lb.choose() == 1


def test_counts_come_before_work_a_free_slot_beats_a_short_queue() -> None:
    lb = LoadBalancer(2)
    lb.on_snapshot(StatsSnapshot(counts=[(0, 1), (1, 2)], wave=0, running=False, work=[60, 12]))
    assert lb.choose() == 0


def test_a_send_books_its_max_tokens_as_work_for_every_peer_front_end() -> None:
    lb = LoadBalancer(2, client_count=2)
    lb.on_snapshot(StatsSnapshot(counts=[(0, 0), (0, 0)], wave=0, running=False, work=[0, 100]))
    lb.on_sent(0, max_tokens=64)
    assert (lb.score(0), lb.work(0)) == (2 * WAITING_WEIGHT, 128), "64 tokens, and the peer may have sent as much"
    lb.undo_sent(0, max_tokens=64)
    assert (lb.score(0), lb.work(0)) == (0, 0)


def test_without_work_in_the_snapshot_only_our_own_sends_break_ties() -> None:
    lb = LoadBalancer(2)
    lb.on_snapshot(StatsSnapshot(counts=[(0, 1), (0, 1)], wave=0, running=False))
    assert (lb.work(0), lb.work(1)) == (0, 0)
    lb.on_sent(0, max_tokens=1000)
    lb.on_finished(0)
    lb.on_sent(1, max_tokens=10)
    lb.on_finished(1)
    assert lb.choose() == 1, "even counts: the rank we sent fewer tokens to"


def test_work_unknown_for_some_rank_is_ignored_for_all() -> None:
    """A rank added by a scale-up reports no work at first (-1): comparing it would be meaningless."""
    lb = LoadBalancer(2)
    lb.on_snapshot(StatsSnapshot(counts=[(0, 1), (0, 1)], wave=0, running=False, work=[90, -1]))
    assert (lb.work(0), lb.work(1)) == (0, 0)
    assert lb.choose() == 0
