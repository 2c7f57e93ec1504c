"""Prefix-cache pictures: engines' cache events, the coordinator's numbered changes, every client's index.

Pure logic: the same objects the engine loop, the coordinator and the client
use, wired by hand in place of the sockets between them.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raydp.client.balancer import LoadBalancer
from raydp.client.prefix import preference, prefix_key
from raydp.coordinator.cache import CachePictures
from raydp.coordinator.state import CoordinatorState
from raydp.engine.cache_report import CacheReporter
from raydp.errors import ConfigError
from raydp.models.prefix_cache import BlockCache
from raydp.wire.blocks import ROOT, CacheEvents, block_digest, block_digests, iter_digests
from raydp.wire.codec import encode
from raydp.wire.control import (
    CacheReport,
    CacheWanted,
    EngineDead,
    EngineStats,
    ScaleEngines,
    StatsSnapshot,
    coordinator_decoder,
    snapshot_decoder,
)

pytestmark = pytest.mark.timeout(120)
BS = 4


def test_blocks_are_named_by_their_tokens_and_every_block_before_them() -> None:
    a = block_digests(list(range(10)), BS)
    assert len(a) == 2  # the partial third block has no name
    assert a == block_digests(list(range(8)), BS)  # the same prefix, the same names, in any process
    assert a[0] == block_digest(ROOT, [0, 1, 2, 3])
    assert a[1] == block_digest(a[0], [4, 5, 6, 7])
    assert block_digests([9, 9, 9, 9, 4, 5, 6, 7], BS)[1] != a[1]  # same tokens after another parent
    assert all(0 <= d < 2**64 for d in a)
    assert next(iter_digests(list(range(10**6)), BS)) == a[0]  # lazy: a long prompt costs what is read


def test_the_reference_cache_counts_hits_from_the_first_block_and_evicts_the_least_recently_used() -> None:
    cache = BlockCache(capacity=3, block_size=BS)
    assert cache.admit(list(range(8))) == 0
    assert cache.admit([*range(8), 50, 51, 52, 53]) == 8  # two blocks found, the third stored
    first = cache.events(full=False)
    assert first is not None and len(first.stored) == 3 and first.queried == 20 and first.hits == 8
    assert cache.events(full=False) is None  # nothing since
    cache.admit([7, 7, 7, 7])  # a fourth block: the least recently used (block 0) goes
    ev = cache.events(full=False)
    assert ev is not None and ev.removed == [block_digests(list(range(4)), BS)[0]]
    assert cache.admit(list(range(8))) == 0  # its first block is gone: nothing after it counts
    whole = cache.events(full=True)
    assert whole is not None and whole.full and sorted(whole.stored) == sorted(cache._blocks)
    with pytest.raises(ConfigError, match="prefix_cache_blocks=0: must be >= 1"):
        BlockCache(0)


def _snapshot(state: CoordinatorState, now: float) -> StatsSnapshot:
    snap = state.due_snapshot(now)
    assert snap is not None
    return snapshot_decoder(encode(snap))  # what crosses the socket


class Rank:
    """One engine as the loop runs it: a reference prefix cache and the loop's own reporter, whose
    reports go into the coordinator's state (or are lost on the way, when told to)."""

    def __init__(self, state: CoordinatorState, rank: int, capacity: int = 64) -> None:
        self.state, self.cache = state, BlockCache(capacity, BS)
        self.reporter = CacheReporter(self, rank, self._send, gap_s=0.0)
        self.lose = 0  # reports to lose on the way

    def cache_events(self, full: bool) -> CacheEvents | None:
        return self.cache.events(full)

    def _send(self, msg: CacheReport) -> bool:
        msg = coordinator_decoder(encode(msg))  # type: ignore[assignment]
        if self.lose:
            self.lose -= 1
        else:
            self.state.handle(msg)
        return True

    def serve(self, prompt: list[int], now: float) -> None:
        self.cache.admit(prompt)
        self.reporter.maybe_send(now)


def test_a_client_sees_what_each_engine_reports_and_forgets_a_dead_rank() -> None:
    state = CoordinatorState(engine_count=2)
    rank0, rank1 = Rank(state, 0), Rank(state, 1)
    shared, own = list(range(12)), [9] * 8
    rank0.serve(shared, 0.5)
    rank1.serve(shared[:8] + own, 0.5)
    lb = LoadBalancer(2, policy="prefix")
    assert lb.on_snapshot(_snapshot(state, 1.0)) == []
    assert lb.cache.longest(shared, [0, 1]) == ([0], 3)  # rank 0 holds all three blocks
    assert lb.cache.longest(shared[:8] + own, [0, 1]) == ([1], 4)
    assert lb.cache.longest(shared[:8], [0, 1]) == ([0, 1], 2)
    assert lb.cache.longest([5] * 12, [0, 1]) == ([], 0)
    assert [list(h) for h in _snapshot(state, 3.0).hits] == [[12, 0], [16, 0]]

    state.handle(EngineDead(rank=0, cause="killed"))
    rank0.serve(shared, 4.0)  # the dead engine's last words come after its death notice
    lb.on_snapshot(_snapshot(state, 5.0))
    assert lb.cache.longest(shared, [0, 1]) == ([1], 2)  # rank 0's cache died with it
    assert state.status().prefix_cache == [[0, 0], [16, 0]]
    replacement = Rank(state, 0)
    replacement.serve([7] * 4, 6.0)
    lb.on_snapshot(_snapshot(state, 7.0))
    assert lb.cache.longest([7] * 4, [0, 1]) == ([0], 1) and lb.cache.blocks(0) == 1


def test_a_replacement_that_reports_before_the_death_notice_keeps_its_picture() -> None:
    state = CoordinatorState(engine_count=1)
    old, new = Rank(state, 0), Rank(state, 0)
    old.serve(list(range(8)), 0.5)
    new.serve([5] * 8, 1.0)  # the restarted rank speaks first...
    state.handle(EngineDead(rank=0, cause="killed"))  # ...then the launcher reports the old one's death
    old.serve([6] * 8, 1.5)  # and a report the dead process had in flight arrives
    assert state.cache.blocks(0) == 2 == len(new.cache)


def test_a_death_reported_twice_after_the_replacement_spoke_keeps_the_replacements_picture() -> None:
    state = CoordinatorState(engine_count=1)
    old, new = Rank(state, 0), Rank(state, 0)
    old.serve(list(range(8)), 0.5)
    new.serve([5] * 8, 1.0)  # the restarted rank speaks first, then two paths report the old one's death
    state.handle(EngineDead(rank=0, cause="killed"))
    state.handle(EngineDead(rank=0, cause="killed"))
    assert state.cache.blocks(0) == 2 == len(new.cache)
    assert state.cache.hit_counts()[0][0] > 0, "the replacement's lookups still count"
    assert state.deaths == [1]


def test_a_lost_engine_report_is_made_up_for_by_a_whole_one() -> None:
    state = CoordinatorState(engine_count=1)
    rank = Rank(state, 0)
    rank.serve(list(range(8)), 0.5)
    rank.lose = 1
    rank.serve([3] * 8, 1.0)  # lost on the way
    rank.serve([4] * 8, 1.5)  # a delta after a gap: not taken, the engine is asked for its whole cache
    assert state.cache.blocks(0) == 2
    assert state.cache.asks(2.0) == [0] and state.cache.asks(2.5) == []  # asked once a second at most
    rank.reporter.send_full(3.0)  # what the engine does on SendCache
    assert state.cache.blocks(0) == 6 == len(rank.cache)


def test_a_client_that_missed_a_change_asks_for_the_whole_picture_and_then_agrees() -> None:
    state = CoordinatorState(engine_count=1)
    rank = Rank(state, 0)
    late = LoadBalancer(1, policy="prefix")
    rank.serve(list(range(8)), 0.5)
    _snapshot(state, 1.0)  # published before the late client subscribed
    rank.serve([3] * 8, 1.5)
    assert late.on_snapshot(_snapshot(state, 2.0)) == [0]  # a change on top of one it never saw
    assert late.cache.blocks(0) == 0
    state.handle(CacheWanted(rank=0))
    assert late.on_snapshot(_snapshot(state, 3.0)) == []
    assert late.cache.blocks(0) == 4 == len(rank.cache)


def test_a_successors_numbering_never_lands_on_its_predecessors_pictures() -> None:
    first, successor = CoordinatorState(engine_count=1), CoordinatorState(engine_count=1)
    client = LoadBalancer(1, policy="prefix")
    Rank(first, 0).serve(list(range(8)), 0.5)
    client.on_snapshot(_snapshot(first, 1.0))
    assert client.cache.blocks(0) == 2
    Rank(successor, 0).serve([2] * 4, 1.5)  # the same version numbers, another picture
    client.on_snapshot(_snapshot(successor, 2.0))
    assert client.cache.blocks(0) == 1 and client.cache.longest(list(range(8)), [0]) == ([], 0)


def test_a_scale_down_forgets_the_removed_ranks_blocks_in_the_coordinator_and_the_clients() -> None:
    state = CoordinatorState(engine_count=3)
    lb = LoadBalancer(3, policy="prefix")
    prompt = list(range(8))
    Rank(state, 2).serve(prompt, 0.5)
    lb.on_snapshot(_snapshot(state, 1.0))
    assert lb.cache.longest(prompt, [0, 1, 2]) == ([2], 2)
    state.handle(ScaleEngines(engine_count=2))
    lb.resize(2, 2)
    assert lb.cache.blocks(2) == 0 and state.cache.hit_counts() == [(0, 0), (0, 0)]


def test_a_ranks_picture_is_bounded_and_reports_at_another_block_size_are_refused() -> None:
    pictures = CachePictures(2, max_blocks=10)
    pictures.report(CacheReport(0, 1, 1, CacheEvents(BS, stored=list(range(1, 26)), full=True)))
    assert pictures.blocks(0) == 10
    (change,) = pictures.changes(1.0)
    assert sorted(change.stored) == list(range(1, 11))  # the first known stay: hot prefixes are not re-reported
    pictures.report(CacheReport(1, 2, 1, CacheEvents(BS * 2, stored=[5], full=True)))
    assert pictures.blocks(1) == 0 and pictures.refused == 1


def test_the_rank_holding_the_prefix_wins_over_the_hash_within_the_load_margin() -> None:
    lb = LoadBalancer(2, policy="prefix", prefix_load_margin=8)
    prompt = next(p for p in ([i] * 16 for i in range(100)) if preference(prefix_key(p), [0, 1])[0] == 0)
    state = CoordinatorState(engine_count=2)
    Rank(state, 1).serve(prompt, 0.5)
    lb.on_snapshot(_snapshot(state, 1.0))
    assert lb.choose((), prompt) == 1  # the hash says 0; rank 1 holds it
    assert lb.choose((), [x + 1 for x in prompt]) in (0, 1)  # nobody holds this one: the hash decides
    state.handle(EngineStats(rank=1, waiting=3, running=0))  # 12 over the least-loaded: past the margin
    lb.on_snapshot(_snapshot(state, 3.0))
    assert lb.choose((), prompt) == 0
    assert lb.choose({0}, prompt) == 1  # the holder is the only live rank


Event = st.tuples(
    st.sampled_from(["admit", "die"]),
    st.integers(0, 3),
    st.lists(st.integers(0, 5), min_size=BS, max_size=4 * BS),
    st.booleans(),  # the lossy client never gets this change's snapshot
)


@settings(max_examples=150, deadline=None)
@given(events=st.lists(Event, max_size=40))
def test_every_client_ends_with_the_engines_picture_whatever_it_missed(
    events: list[tuple[str, int, list[int], bool]],
) -> None:
    state = CoordinatorState(engine_count=4)
    ranks = [Rank(state, r, capacity=6) for r in range(4)]
    steady, lossy = LoadBalancer(4, policy="prefix"), LoadBalancer(4, policy="prefix")
    now = 0.0
    for kind, rank, prompt, lost in events:
        now += 1.0
        if kind == "admit":
            ranks[rank].serve(prompt, now)
        else:
            state.handle(EngineDead(rank=rank, cause="killed"))
            ranks[rank] = Rank(state, rank, capacity=6)  # its replacement starts empty and says so in full
            ranks[rank].serve([], now)
        snap = _snapshot(state, now)
        assert steady.on_snapshot(snap) == []  # a client that misses nothing never asks
        if not lost:
            for missed in lossy.on_snapshot(snap):
                state.handle(CacheWanted(rank=missed))
    for extra in (1, 2):  # heartbeats: the lossy client learns what it is behind on and catches up
        for missed in lossy.on_snapshot(_snapshot(state, now + extra)):
            state.handle(CacheWanted(rank=missed))
    for rank, engine in enumerate(ranks):
        held = set(engine.cache._blocks)
        assert state.cache.blocks(rank) == len(held)
        for client in (steady, lossy):
            assert client.cache._blocks.get(rank, set()) == held
