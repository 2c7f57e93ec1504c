"""Which rank gets the next request: pure logic, no sockets.

The score of a rank is ``4 * waiting + running`` from the latest coordinator
snapshot, plus what this client sent it since that snapshot (4 per request,
scaled by ``client_count``, on the assumption that peer front-ends send
alike). Counting sends since the snapshot is what keeps a burst from all
landing on the rank that looked idle a moment ago; the snapshot alone is
always stale. Ties go to the rank with the least *work* (the tokens its engine
has left to generate, where engines report it, plus the ``max_tokens`` this
client sent it since): by count, a rank busy with two long requests looks like
one busy with two short ones, and a request sent behind the long ones waits
the longest (the tail of a skewed workload). Counts come first because they
say whether a request can start at once; work alone would queue short
requests behind short ones next to a free slot.

The ``prefix`` policy adds cache affinity: a request goes to the first rank in
its prompt prefix's order of preference (:mod:`raydp.client.prefix`) whose
load is within ``prefix_load_margin`` of the least-loaded rank's; that
comparison counts only the sends since the snapshot that still run
(:meth:`LoadBalancer.running_score`), so a prefix sent one request at a time
stays on its rank however long the next snapshot takes; past that
margin load wins, as in SGLang's cache-aware policy, and the overflow of a hot
prefix goes to its next preferred rank, so that it warms one more cache rather
than all of them. Where engines report what their caches hold
(:mod:`raydp.client.cache_index`), the ranks holding the longest cached prefix
of the prompt come first in that order: a hot prefix's overflow rank, or a
rank that served the same conversation's earlier turns, is known to hold it.

A request for a LoRA adapter (``least-loaded`` and ``prefix``, unless
``adapter_affinity=False``) first narrows the choice to the ranks that hold
its adapter (:mod:`raydp.client.adapters`) and whose load is within
``adapter_load_margin`` of the least-loaded rank's. With none, it goes where
loading the adapter costs least: a rank with a free adapter slot within that
margin, else the rank whose engine would evict (its least recently used
adapter) the adapter least asked for lately, by this client's own sends; so a
tail adapter takes a tail adapter's slot, not a hot one's. So a cold adapter stays on one rank, and a hot one spreads to
one more rank each time its holders pass the margin. The policy then picks
among those ranks as usual: prefix affinity applies among an adapter's holders.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Collection, Sequence
from typing import Literal, get_args

from raydp.client.adapters import AdapterIndex
from raydp.client.cache_index import CacheIndex
from raydp.client.prefix import DEFAULT_PREFIX_TOKENS, preference, prefix_key
from raydp.errors import ConfigError
from raydp.wire.control import StatsSnapshot

WAITING_WEIGHT = 4
DEFAULT_PREFIX_LOAD_MARGIN = 4 * WAITING_WEIGHT  # four waiting requests more than the least-loaded rank
DEFAULT_ADAPTER_LOAD_MARGIN = 4 * WAITING_WEIGHT  # loading an adapter costs a stall: four waiting requests' worth
Policy = Literal["least-loaded", "power-of-two", "round-robin", "prefix"]
POLICIES: tuple[str, ...] = get_args(Policy)


class LoadBalancer:
    """Least-loaded choice over ``engine_count`` ranks, tracking this client's sends.

    ``eligible`` restricts the choice to some ranks (an API server in hybrid
    mode routes only to its own node's ranks); a pinned rank may still be any.
    :meth:`resize` follows a scale change: new requests go only to the first
    ``size`` ranks, while the rest (draining) keep their in-flight counts.
    """

    def __init__(
        self,
        engine_count: int,
        client_count: int = 1,
        eligible: Collection[int] | None = None,
        policy: Policy = "least-loaded",
        prefix_tokens: int = DEFAULT_PREFIX_TOKENS,
        prefix_load_margin: int = DEFAULT_PREFIX_LOAD_MARGIN,
        adapter_affinity: bool = True,
        adapter_load_margin: int = DEFAULT_ADAPTER_LOAD_MARGIN,
    ) -> None:
        if policy not in POLICIES:
            raise ConfigError(f"policy={policy!r}: must be one of {', '.join(POLICIES)}")
        if not isinstance(adapter_affinity, bool):
            raise ConfigError(f"adapter_affinity={adapter_affinity!r}: must be a bool")
        if isinstance(adapter_load_margin, bool) or not isinstance(adapter_load_margin, int) or adapter_load_margin < 0:
            raise ConfigError(
                f"adapter_load_margin={adapter_load_margin!r}: must be an int >= 0 (score units: "
                f"{WAITING_WEIGHT} per waiting request, 1 per running one)"
            )
        self.adapter_affinity, self.adapter_load_margin = adapter_affinity, adapter_load_margin
        if prefix_tokens < 1:
            raise ConfigError(f"prefix_tokens={prefix_tokens}: must be >= 1 (the tokens a prefix key covers)")
        if prefix_load_margin < 0:
            raise ConfigError(
                f"prefix_load_margin={prefix_load_margin}: must be >= 0 (score units: "
                f"{WAITING_WEIGHT} per waiting request, 1 per running one)"
            )
        self.policy = policy
        self.prefix_tokens, self.prefix_load_margin = prefix_tokens, prefix_load_margin
        self._turn = itertools.count()
        self._random = random.Random()
        if engine_count < 1:
            raise ConfigError(f"engine_count={engine_count}: must be >= 1")
        if client_count < 1:
            raise ConfigError(f"client_count={client_count}: must be >= 1")
        ranks = sorted(set(range(engine_count) if eligible is None else eligible))
        if not ranks or not all(isinstance(r, int) and 0 <= r < engine_count for r in ranks):
            raise ConfigError(f"ranks={eligible!r}: must be a non-empty set of ranks in [0, {engine_count})")
        self._chosen = None if eligible is None else frozenset(ranks)  # None: every rank, as the cluster grows
        self.eligible: tuple[int, ...] = tuple(ranks)
        self.engine_count = self.size = engine_count
        self.client_count = client_count
        self._snapshot_scores = [0] * engine_count
        self._since_snapshot = [0] * engine_count
        self._snapshot_work = [0] * engine_count  # zeros where engines report none
        self._since_work = [0] * engine_count
        self._in_flight = [0] * engine_count
        self.wave = 0
        self.running = False
        self.cache = CacheIndex()
        self.adapters = AdapterIndex(engine_count)

    def resize(self, engine_count: int, size: int) -> None:
        """``engine_count`` ranks exist; route to the first ``size`` (the others drain, then go)."""
        if not 1 <= size <= engine_count:
            raise ConfigError(f"size={size}: must be in [1, engine_count={engine_count}]")

        def fit(values: list[int]) -> list[int]:
            return (values + [0] * engine_count)[:engine_count]

        self._snapshot_scores = fit(self._snapshot_scores)
        self._since_snapshot = fit(self._since_snapshot)
        self._snapshot_work = fit(self._snapshot_work)
        self._since_work = fit(self._since_work)
        self._in_flight = fit(self._in_flight)
        self.engine_count, self.size = engine_count, size
        self.cache.truncate(engine_count)
        self.adapters.truncate(engine_count)
        self.eligible = tuple(r for r in range(size) if self._chosen is None or r in self._chosen)

    def in_flight(self, rank: int) -> int:
        """This client's requests on ``rank`` that have not finished."""
        return self._in_flight[rank] if rank < self.engine_count else 0

    def choose(
        self,
        dead: Collection[int] = (),
        prompt: Sequence[int] | None = None,
        adapter: str = "",
        among: range | None = None,
        by_prefix: bool = False,
    ) -> int:
        """The live rank for the next request, by :attr:`policy`.

        ``least-loaded`` (the default): the lowest score (ties: least work, then
        fewest of ours in flight, then lowest rank). ``prefix``: see the module
        docstring (``prompt`` is the request's; without one it is least-loaded).
        ``power-of-two`` and ``round-robin`` are the usual alternatives, kept for
        comparison (``python -m benchmarks --only routing``). ``adapter``: the
        request's LoRA adapter, see the module docstring. ``among``: the ranks of
        the request's pool (P/D), None for every rank. ``by_prefix``: prefix
        affinity for this choice where the policy is ``least-loaded`` (a P/D
        prefill: the prefill pool is where a prompt's cached prefix pays).
        """
        live = [r for r in self.eligible if r not in dead and (among is None or r in among)]
        if not live:
            pool = "" if among is None else f" in ranks {among.start}..{among.stop - 1}"
            raise ConfigError(f"no live engine to send to{pool}: every rank this client may use is dead or removed")
        policy = "prefix" if by_prefix and self.policy == "least-loaded" else self.policy
        if policy == "round-robin":
            return live[next(self._turn) % len(live)]
        if policy == "power-of-two" and len(live) > 2:
            live = self._random.sample(live, 2)
        if adapter and self.adapter_affinity and policy in ("least-loaded", "prefix"):
            live = self._adapter_ranks(live, adapter)
        least = min(live, key=lambda rank: (self.score(rank), self.work(rank), self._in_flight[rank], rank))
        if policy != "prefix" or not prompt:
            return least
        bound = min(self.running_score(rank) for rank in live) + self.prefix_load_margin
        order = preference(prefix_key(prompt, self.prefix_tokens), live)
        holders, _ = self.cache.longest(prompt, live)
        if holders:
            order = [r for r in order if r in holders] + [r for r in order if r not in holders]
        return next(rank for rank in order if self.running_score(rank) <= bound)

    def _adapter_ranks(self, live: list[int], adapter: str) -> list[int]:
        """The ranks a request for ``adapter`` may go to: its holders within the margin, else where loading
        it costs least (see the module docstring)."""
        bound = min(self.running_score(rank) for rank in live) + self.adapter_load_margin
        near = [rank for rank in live if self.running_score(rank) <= bound]
        holders = [rank for rank in near if self.adapters.holds(rank, adapter)]
        if holders:
            return holders
        free = [rank for rank in near if self.adapters.has_free_slot(rank)]
        if free:
            return free
        cost = {rank: self.adapters.eviction_cost(rank) for rank in near}
        cheapest = min(cost.values())
        return [rank for rank in near if cost[rank] == cheapest]

    def score(self, rank: int) -> int:
        """The snapshot's load plus every send since it: a burst spreads, even of requests already done."""
        return self._snapshot_scores[rank] + WAITING_WEIGHT * self._since_snapshot[rank]

    def running_score(self, rank: int) -> int:
        """:meth:`score` counting only the sends since the snapshot that still run (what the prefix margin
        compares): sent one at a time, a prefix's requests never make its rank look loaded."""
        running = min(self._since_snapshot[rank], self._in_flight[rank] * self.client_count)
        return self._snapshot_scores[rank] + WAITING_WEIGHT * running

    def work(self, rank: int) -> int:
        """The rank's work in the snapshot plus the ``max_tokens`` sent there since (the tie-break)."""
        return self._snapshot_work[rank] + self._since_work[rank]

    def on_sent(self, rank: int, max_tokens: int = 1, adapter: str = "") -> None:
        self.adapters.on_sent(rank, adapter)
        self._since_snapshot[rank] += self.client_count
        self._since_work[rank] += self._booked_work(max_tokens)
        self._in_flight[rank] += 1

    def undo_sent(self, rank: int, max_tokens: int = 1) -> None:
        """Take back an :meth:`on_sent` (a batch books its choices first, then sends them)."""
        self._since_snapshot[rank] = max(0, self._since_snapshot[rank] - self.client_count)
        self._since_work[rank] = max(0, self._since_work[rank] - self._booked_work(max_tokens))
        self._in_flight[rank] = max(0, self._in_flight[rank] - 1)

    def _booked_work(self, max_tokens: int) -> int:
        """What one send adds to a rank's work until the next snapshot (peers assumed to send alike)."""
        return self.client_count * max(1, max_tokens)

    def on_finished(self, rank: int) -> None:
        self._in_flight[rank] = max(0, self._in_flight[rank] - 1)

    def on_snapshot(self, snap: StatsSnapshot) -> list[int]:
        """Adopt the coordinator's latest view (one publisher: snapshots arrive in order).

        Returns the ranks whose cache pictures this client fell behind on (it
        missed a snapshot): the coordinator is to publish them whole.
        """
        self.wave, self.running = snap.wave, snap.running
        for rank, (waiting, running) in enumerate(snap.counts[: self.engine_count]):
            self._snapshot_scores[rank] = WAITING_WEIGHT * waiting + running
        reported = len(snap.work) == len(snap.counts) and all(w >= 0 for w in snap.work)
        works = snap.work if reported else []
        self._snapshot_work = (list(works[: self.engine_count]) + [0] * self.engine_count)[: self.engine_count]
        self._since_snapshot = [0] * self.engine_count
        self._since_work = [0] * self.engine_count
        self.adapters.on_snapshot(snap.adapters, snap.adapter_paths)
        self.cache.follow(snap.cache_epoch)
        for change in snap.cache:
            if 0 <= change.rank < self.engine_count:
                self.cache.apply(change)
        return [rank for rank in self.cache.behind(snap.cache_versions) if rank < self.engine_count]

    def note_first_request(self) -> bool:
        """True when this send starts a wave (the coordinator must be told)."""
        if self.running:
            return False
        self.running = True
        return True
