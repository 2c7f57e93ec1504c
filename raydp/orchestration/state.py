"""The cluster's shared facts, with one owner: :class:`ClusterState`.

Startup, the restart policies and scaling all read the same facts: how many
ranks a joining rank is told there are, the wave it starts in, where the DP
group rendezvous, the coordinator's addresses, the endpoints clients route
to, and the rank table. They change them only through the named
transitions below, each under the state's lock, so who may change what, and
when, is written in one file. The property machines call :meth:`check`
after every step.

Invariants:

- ``wave`` never goes back: a stale read of the coordinator's wave cannot
  move a joining rank into a wave its gang has left;
- ``len(table) == dp_size + joining``: ranks being added by a scale-up are
  in the table, built but not yet told the new size;
- the endpoints name ranks of the table, and their coordinator is ``coordinator``;
- in a P/D cluster each pool keeps a rank: ``0 < prefill_ranks < len(endpoints.engines)``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import msgspec

from raydp.orchestration.ranks import RankRecord, RankTable
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint


class ClusterState:
    """See the module docstring. Read the facts as attributes; change them through the methods."""

    def __init__(self, dp_size: int, table: RankTable | None = None) -> None:
        self.lock = threading.RLock()
        self.table = table if table is not None else RankTable()
        self._dp_size = dp_size
        self._joining = 0
        self._wave = 0
        self._dp_master = ""
        self._coordinator: CoordinatorEndpoints | None = None
        self._endpoints: ClusterEndpoints | None = None

    # ---- the facts --------------------------------------------------------------------

    @property
    def dp_size(self) -> int:
        """The size a rank's INIT names: the cluster's size now (a scale change moves it)."""
        return self._dp_size

    @property
    def joining(self) -> int:
        """Ranks a scale-up has added to the table but not yet told the new size."""
        return self._joining

    @property
    def wave(self) -> int:
        """The wave a rank joining a running lockstep cluster starts in."""
        return self._wave

    @property
    def dp_master(self) -> str:
        """Where the lockstep DP group rendezvous ('' for dense clusters)."""
        return self._dp_master

    @property
    def coordinator(self) -> CoordinatorEndpoints | None:
        return self._coordinator

    @property
    def endpoints(self) -> ClusterEndpoints | None:
        """What clients route by; None until the cluster serves."""
        return self._endpoints

    @property
    def prefill_ranks(self) -> int:
        """P/D: ranks ``0..prefill_ranks-1`` prefill, the others decode (0: no pools, or not serving yet)."""
        return self._endpoints.prefill_ranks if self._endpoints is not None else 0

    # ---- transitions: startup and restarts --------------------------------------------

    def launched(self, records: Sequence[RankRecord]) -> None:
        """The launch placed ``records``, ranks ``0..dp_size-1``."""
        with self.lock:
            if len(self.table) + len(records) != self._dp_size:
                raise ValueError(f"launched {len(records)} ranks of dp_size={self._dp_size}")
            self.table.extend(records)

    def replace_rank(self, record: RankRecord) -> None:
        """A rank was re-placed (its node died): ``record`` is where it runs now."""
        with self.lock:
            self.table.replace(record)

    def coordinator_started(self, coordinator: CoordinatorEndpoints) -> None:
        """The coordinator serves at ``coordinator`` (at launch, or a successor at the same addresses)."""
        with self.lock:
            self._coordinator = coordinator

    def rendezvous_at(self, dp_master: str) -> None:
        """The next DP group forms at ``dp_master`` (launch, a gang restart)."""
        with self.lock:
            self._dp_master = dp_master

    def serving(self, endpoints: ClusterEndpoints) -> None:
        """Startup is done: clients route by ``endpoints``."""
        with self.lock:
            if endpoints.coordinator != self._coordinator:
                raise ValueError("the endpoints name another coordinator than the one that started")
            self._endpoints = endpoints

    def rank_rejoined(self, endpoint: EngineEndpoint) -> ClusterEndpoints:
        """A restarted rank serves at new addresses."""
        with self.lock:
            assert self._endpoints is not None, "a rank rejoined a cluster that never served"
            self._endpoints = self._endpoints.with_engine(endpoint)
            return self._endpoints

    def replace_coordinator(self, coordinator: CoordinatorEndpoints) -> ClusterEndpoints:
        """The coordinator's successor serves elsewhere: everything follows it there."""
        with self.lock:
            assert self._endpoints is not None, "the coordinator moved before the cluster served"
            self._coordinator = coordinator
            self._endpoints = msgspec.structs.replace(self._endpoints, coordinator=coordinator)
            return self._endpoints

    def advance_wave(self, wave: int) -> None:
        """Joining ranks start in ``wave``, unless the cluster is already past it."""
        with self.lock:
            self._wave = max(self._wave, wave)

    # ---- transitions: scaling ---------------------------------------------------------

    def add_ranks(self, records: Sequence[RankRecord]) -> None:
        """A scale-up placed ``records``: in the table, not yet part of the size."""
        with self.lock:
            self.table.extend(records)
            self._joining += len(records)

    def grow(self) -> None:
        """The added ranks join: the size includes them from here on."""
        with self.lock:
            self._dp_size += self._joining
            self._joining = 0

    def abandon_growth(self, size: int) -> list[RankRecord]:
        """A scale-up failed: back to ``size`` ranks; returns the ranks it had added."""
        with self.lock:
            self._dp_size, self._joining = size, 0
            return self.table.truncate(size)

    def shrink(self, size: int) -> list[RankRecord]:
        """The ranks from ``size`` up leave the size and the table; returns them, for their engines to end."""
        with self.lock:
            if size > self._dp_size:
                raise ValueError(f"shrink to {size} of {self._dp_size} ranks")
            self._dp_size = size
            return self.table.truncate(size)

    def route_to(self, engines: Iterable[EngineEndpoint]) -> ClusterEndpoints:
        """Clients route to ``engines`` from now on (a scale change opened or closed ranks)."""
        with self.lock:
            assert self._endpoints is not None, "a scale change of a cluster that never served"
            engines = list(engines)
            self._endpoints = self._endpoints.with_engines(engines, self.table.capacity(e.rank for e in engines))
            return self._endpoints

    def move_boundary(self, prefill: int) -> ClusterEndpoints:
        """P/D: ranks ``0..prefill-1`` prefill from now on (:mod:`raydp.orchestration.pools`)."""
        with self.lock:
            assert self._endpoints is not None and self._endpoints.prefill_ranks, "a boundary of a P/D cluster"
            if not 0 < prefill < len(self._endpoints.engines):
                raise ValueError(f"prefill_ranks={prefill} of {len(self._endpoints.engines)} ranks")
            self._endpoints = msgspec.structs.replace(self._endpoints, prefill_ranks=prefill)
            return self._endpoints

    # ---- invariants -------------------------------------------------------------------

    def check(self) -> None:
        """AssertionError naming the broken invariant (see the module docstring)."""
        with self.lock:
            assert len(self.table) == self._dp_size + self._joining, (
                f"{len(self.table)} ranks in the table, dp_size {self._dp_size} + {self._joining} joining"
            )
            if self._endpoints is not None:
                ranks = [e.rank for e in self._endpoints.engines]
                assert all(r in self.table for r in ranks), f"endpoints name ranks {ranks} of {len(self.table)}"
                assert self._endpoints.coordinator == self._coordinator, "endpoints name another coordinator"
                pools = self._endpoints.prefill_ranks
                assert not pools or 0 < pools < len(ranks), f"prefill_ranks={pools} leaves a pool of {ranks} empty"


__all__ = ["ClusterState"]
