"""The cluster's shared facts change only through ClusterState's transitions, which keep its invariants."""

from __future__ import annotations

import pytest

from raydp.orchestration.ranks import RankRecord
from raydp.orchestration.state import ClusterState
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint

pytestmark = pytest.mark.timeout(30)

COORD = CoordinatorEndpoints("node0", ["ipc://pub"], ["ipc://collect"], ["ipc://bcast"])


def _records(ranks: range) -> list[RankRecord]:
    return [RankRecord(r, f"node{r}", capacity=10) for r in ranks]


def _engines(ranks: range) -> list[EngineEndpoint]:
    return [EngineEndpoint(r, f"node{r}", [f"ipc://in{r}"]) for r in ranks]


def _serving(n: int) -> ClusterState:
    state = ClusterState(n)
    state.launched(_records(range(n)))
    state.coordinator_started(COORD)
    state.serving(ClusterEndpoints("c", _engines(range(n)), COORD, False, 10 * n))
    state.check()
    return state


def test_a_launch_must_place_exactly_dp_size_ranks() -> None:
    with pytest.raises(ValueError, match="launched 2 ranks of dp_size=3"):
        ClusterState(3).launched(_records(range(2)))


def test_endpoints_must_name_the_coordinator_that_started() -> None:
    state = ClusterState(1)
    state.launched(_records(range(1)))
    state.coordinator_started(COORD)
    other = CoordinatorEndpoints("node9", [], [], [])
    with pytest.raises(ValueError, match="another coordinator"):
        state.serving(ClusterEndpoints("c", _engines(range(1)), other, False))


def test_a_scale_up_counts_its_ranks_as_joining_until_they_join() -> None:
    state = _serving(2)
    state.add_ranks(_records(range(2, 4)))
    assert (state.dp_size, state.joining, len(state.table)) == (2, 2, 4)
    state.check()
    state.grow()
    assert (state.dp_size, state.joining) == (4, 0)
    endpoints = state.route_to(_engines(range(4)))
    assert [e.rank for e in endpoints.engines] == [0, 1, 2, 3] and endpoints.capacity == 40
    state.check()


def test_a_failed_scale_up_returns_the_ranks_it_added() -> None:
    state = _serving(2)
    state.add_ranks(_records(range(2, 5)))
    state.grow()
    gone = state.abandon_growth(2)
    assert [r.rank for r in gone] == [2, 3, 4]
    assert (state.dp_size, state.joining, len(state.table)) == (2, 0, 2)
    state.check()


def test_a_scale_down_drops_the_highest_ranks_and_their_routes() -> None:
    state = _serving(4)
    state.route_to(_engines(range(4)))
    gone = state.shrink(1)
    assert [r.rank for r in gone] == [1, 2, 3] and state.dp_size == 1
    state.route_to(_engines(range(1)))
    state.check()
    with pytest.raises(ValueError, match="shrink to 3 of 1"):
        state.shrink(3)


def test_the_wave_never_goes_back() -> None:
    state = _serving(2)
    state.advance_wave(7)
    state.advance_wave(5)  # a stale read of the coordinator's wave
    assert state.wave == 7


def test_a_moved_coordinator_is_named_by_the_endpoints_too() -> None:
    state = _serving(2)
    moved = CoordinatorEndpoints("node1", ["tcp://a"], ["tcp://b"], ["tcp://c"])
    endpoints = state.replace_coordinator(moved)
    assert state.coordinator == endpoints.coordinator == moved
    state.check()


def test_a_rejoined_rank_moves_its_endpoint_only() -> None:
    state = _serving(2)
    endpoints = state.rank_rejoined(EngineEndpoint(1, "node1", ["ipc://new"]))
    assert [e.input_addresses for e in endpoints.engines] == [["ipc://in0"], ["ipc://new"]]


def test_check_names_a_table_that_disagrees_with_the_size() -> None:
    state = _serving(2)
    state.table.truncate(1)  # behind the state's back: what the transitions exist to prevent
    with pytest.raises(AssertionError, match="1 ranks in the table, dp_size 2"):
        state.check()
