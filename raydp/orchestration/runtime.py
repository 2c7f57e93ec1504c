"""What the orchestration sequences ask of a backend: the :class:`Runtime` interface.

The sequences (start, restarts, scaling) are plain Python in this package;
each backend implements this small interface over what it runs on:
:class:`raydp.actors.runtime.RayRuntime` over Ray actors and placement
groups, :class:`raydp.local.runtime.ProcessRuntime` over local processes, and
the unit tests' in-memory runtime over a model. A runtime keeps no rank state
of its own: it reads and writes the :class:`~raydp.orchestration.ranks.RankRecord`
it is handed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from raydp.config import RaydpConfig
from raydp.coordinator.resync import Restored
from raydp.errors import RaydpError
from raydp.orchestration.ranks import RankRecord
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints
from raydp.wire.handshake import HandshakeResult, HandshakeServer
from raydp.wire.protocol import Init
from raydp.wire.records import AutoscaleDecision, CoordinatorStatus

InitFor = Callable[[int], Init]
Progress = Callable[[int, int], None]


class CoordinatorUnavailableError(RaydpError):
    """The coordinator died while a sequence waited on it (its own death is reported apart)."""


class Runtime(Protocol):
    """Spawn, kill, wait and call, for one cluster; see the module docstring.

    ``stop`` is set once the cluster closes: every wait gives up on it.
    ``restarts_gangs`` and ``restarts_coordinator`` say which recoveries the
    backend can run (the ``mp`` backend stops a broken gang and reports its
    coordinator's death instead).
    """

    stop: threading.Event
    restarts_gangs: bool
    restarts_coordinator: bool

    # ---- placement ----------------------------------------------------------------------

    def place(self, ranks: range, existing: Sequence[RankRecord], why: str) -> list[RankRecord]:
        """New records for ``ranks``, placed (and waited for) beside ``existing``."""
        ...

    def remove_groups(self, records: Sequence[RankRecord]) -> None:
        """Remove the placement of ``records`` that raydp made."""
        ...

    def probe_devices(self, records: Sequence[RankRecord]) -> list[Any]:
        """Start finding each rank's device ids; :meth:`resolve_devices` waits for the answers."""
        ...

    def resolve_devices(self, probes: Sequence[Any]) -> list[tuple[str, ...]]: ...

    # ---- engines ------------------------------------------------------------------------

    def spawn_engines(self, records: Sequence[RankRecord], devices: Sequence[Any], successors: bool) -> None:
        """Create the ranks' engines (``record.handle``); ``successors``: their names were just freed."""
        ...

    def wait_built(self, records: Sequence[RankRecord]) -> None:
        """Until the engines have built their engine (before anything waits on them in a group)."""
        ...

    def join(
        self,
        records: Sequence[RankRecord],
        init_for: InitFor,
        progress: Progress | None = None,
        watched: Sequence[RankRecord] = (),
    ) -> HandshakeResult:
        """Run the ranks through the startup handshake; sets ``run_ref`` and ``capacity`` on each.

        Fails at once, naming the rank, if one of ``records`` or ``watched`` ends meanwhile.
        """
        ...

    def kill(self, records: Sequence[RankRecord]) -> None:
        """End the ranks' engines now and wait until their names and resources are free."""
        ...

    def stop_engines(self, records: Sequence[RankRecord]) -> None:
        """End the ranks' engines politely (a scale-down), then for good."""
        ...

    def watch(self, records: Sequence[RankRecord]) -> None:
        """Report the end of each rank's current run from now on."""
        ...

    def retire(self, records: Sequence[RankRecord]) -> None:
        """The ranks' current runs end by raydp's doing: not deaths to report."""
        ...

    def in_flight(self, ranks: Sequence[int]) -> int:
        """Requests on ``ranks`` not finished yet (a dead rank holds none)."""
        ...

    def dp_master(self, size: int, watched: Sequence[RankRecord]) -> str:
        """A new rendezvous for a lockstep DP group of ``size`` ranks."""
        ...

    # ---- the coordinator ----------------------------------------------------------------

    def start_coordinator(
        self, size: int, successor_of: tuple[CoordinatorEndpoints, Restored] | None, moved: bool = False
    ) -> CoordinatorEndpoints:
        """Start the coordinator and watch it. A successor binds its predecessor's addresses on their
        node, or (``moved``: that node died) new ones on a live node."""
        ...

    def follow_coordinator(self, records: Sequence[RankRecord], endpoints: CoordinatorEndpoints) -> list[int]:
        """Tell the ranks' engines that the coordinator moved; returns the ranks that could not be told."""
        ...

    def kill_coordinator(self) -> None: ...

    def coordinator_state(self) -> CoordinatorStatus: ...

    def wait_subscribed(self, count: int, rank: int | None, watched: Sequence[RankRecord]) -> bool:
        """Until ``count`` engines (or engine ``rank``) subscribed; raises CoordinatorUnavailableError."""
        ...

    def record_autoscale(self, decision: AutoscaleDecision) -> None:
        """Keep the autoscaler's latest decision where ``raydp status`` and the metrics read it."""
        ...

    def publish(self, endpoints: ClusterEndpoints, handed: bool) -> None:
        """Record the cluster where ``attach`` and ``raydp status`` find it (``handed``: the whole record)."""
        ...


def join_ranks(
    server: HandshakeServer,
    records: Sequence[RankRecord],
    start: Callable[[list[str]], None],
    same_node: Callable[[RankRecord], bool],
    init_for: InitFor,
    config: RaydpConfig,
    liveness: Callable[[], None],
    progress: Progress | None,
) -> HandshakeResult:
    """Start ``records`` (``start`` gets the handshake's addresses), run them through the handshake on
    ``server`` (closed after, whatever happens) and copy each one's capacity from its READY."""
    try:
        start(server.addresses)
        result = server.run(
            {r.rank: same_node(r) for r in records},
            init_for,
            config.config_hash(),
            config.startup_wait_s,
            liveness=liveness,
            progress=progress,
        )
    finally:
        server.close()
    for record in records:
        record.capacity = result.ready[record.rank].capacity
    return result
