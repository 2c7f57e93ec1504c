"""What a policy may use: :class:`Controls`, handed to each restart and scaling policy.

The policies (:mod:`~raydp.orchestration.restart`, :mod:`~raydp.orchestration.gang`,
:mod:`~raydp.orchestration.coordinator_restart`, :mod:`~raydp.orchestration.scaling`,
:mod:`~raydp.orchestration.autoscaling`) hold no orchestrator. They get the
runtime, the :class:`~raydp.orchestration.state.ClusterState` (whose
transitions are the only way to change the cluster's shared facts), the death
reports, and the few steps every policy shares: publishing rejoined ranks or
new routes, and reporting a death back through the orchestrator's dispatch.
Policies that act on their own clock (the autoscalers, the silence watch) tick
on :func:`tick_while_alive` threads, which hold them weakly.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from raydp.backend import ScaleListener
from raydp.config import RaydpConfig
from raydp.coordinator.client import CoordinatorClient
from raydp.errors import DeathCause
from raydp.orchestration.budget import RestartBudget
from raydp.orchestration.owned import OwnedResources
from raydp.orchestration.ranks import RankRecord, RankTable
from raydp.orchestration.reports import DeathReports
from raydp.orchestration.runtime import Runtime
from raydp.orchestration.state import ClusterState
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint
from raydp.wire.handshake import HandshakeResult, parallel_config
from raydp.wire.protocol import EngineAddresses, Init
from raydp.wire.transport import pick_address

logger = logging.getLogger("raydp.manager")

Report = Callable[[int, DeathCause, str], None]
FROZEN_NOTE_S = 60.0  # a frozen rank's end is reported within this of its kill, or not as that hang


def tick_while_alive(
    owner: Any, step: Callable[[Any], object], interval_s: float, stop: threading.Event, name: str
) -> None:
    """``step(owner)`` every ``interval_s`` on a daemon thread, until ``stop`` is set or ``owner`` is collected.

    The thread holds ``owner`` weakly: a thread holding a policy would hold the
    controls, and through them the cluster's listeners, so a dropped cluster
    handle would never be collected (and closed). A failed step is logged once
    in a row, at warning, and tried again at the next tick.
    """
    ref = weakref.ref(owner)

    def loop() -> None:
        failing = False
        while not stop.wait(interval_s):
            target = ref()
            if target is None:
                return
            try:
                step(target)
                failing = False
            except Exception:
                if not failing:
                    logger.warning("%s: this round failed; trying again every %gs", name, interval_s, exc_info=True)
                failing = True
            del target

    threading.Thread(target=loop, name=name, daemon=True).start()


@dataclass
class Controls:
    """One cluster's runtime, state and reports, and the steps its policies share; see the module docstring.

    ``report`` re-enters the orchestrator's dispatch (a restart that failed is
    a death of its own); ``report_lock`` is held by every report, so a policy
    deciding on a death sees no other one half-applied.
    """

    config: RaydpConfig
    rt: Runtime
    state: ClusterState
    owned: OwnedResources
    report: Report
    control: Callable[[CoordinatorEndpoints], CoordinatorClient]
    budget: RestartBudget  # a dense rank's restarts: granted at startup and on scale-ups, forgotten on scale-downs
    reports: DeathReports = field(default_factory=DeathReports)
    report_lock: threading.RLock = field(default_factory=threading.RLock)
    place_lock: threading.Lock = field(default_factory=threading.Lock)  # re-placed ranks must not share devices
    threads: list[threading.Thread] = field(default_factory=list)
    scale_listeners: list[ScaleListener] = field(default_factory=list)
    # rank -> (when, detail): the silence watch ended the rank as frozen; the end its watcher reports
    # next, within FROZEN_NOTE_S, is that hang (EngineHungError), not a kill.
    frozen: dict[int, tuple[float, str]] = field(default_factory=dict)

    @property
    def table(self) -> RankTable:
        return self.state.table

    def cause_of_end(self, rank: int, cause: DeathCause, detail: str) -> tuple[DeathCause, str]:
        """What a watcher's report of ``rank``'s end means (callers hold the report lock)."""
        note = self.frozen.pop(rank, None)
        if note is not None and time.monotonic() - note[0] < FROZEN_NOTE_S:
            return DeathCause.HUNG, note[1]
        return cause, detail

    def closing(self) -> bool:
        return self.owned.stop.is_set()

    def in_background(self, name: str, target: Callable[..., None], *args: Any) -> None:
        """Run ``target`` (a restart, an end) on a thread of its own: the Ray backend's close joins these
        threads; the ``mp`` backend's close ends processes under the same lock as they do."""
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self.threads.append(thread)
        thread.start()

    def init_for(self, rank: int) -> Init:
        """What rank ``rank`` is told in its handshake: the coordinator's addresses, its DP group."""
        state = self.state
        coord = state.coordinator
        assert coord is not None
        same = state.table[rank].node_id == coord.node_id
        return Init(
            EngineAddresses(pick_address(coord.collect, same_node=same), pick_address(coord.broadcast, same_node=same)),
            parallel_config(self.config, state.dp_master, state.dp_size, state.wave, rank),
        )

    def publish_restart(self, records: Sequence[RankRecord], result: HandshakeResult) -> None:
        """Restarted ranks rejoined: new endpoints everywhere, watched from now on."""
        endpoints = None
        for record in records:
            record.restarts += 1
            endpoint = EngineEndpoint(record.rank, record.node_id, result.ready[record.rank].input_addresses)
            endpoints = self.state.rank_rejoined(endpoint)
        if endpoints is None:
            return
        self.rt.publish(endpoints, handed=False)
        self.rt.watch(records)
        for record in records:
            self.reports.revived(endpoints.engines[record.rank])

    def publish_routes(self, engines: Sequence[EngineEndpoint], size: int, drain_timeout_s: float | None) -> None:
        """Clients route to ``engines``: this process, the cluster's record (for ``attach``), every listener."""
        self.publish(self.state.route_to(engines), size, drain_timeout_s)

    def publish(self, endpoints: ClusterEndpoints, size: int, drain_timeout_s: float | None) -> None:
        """The cluster's record (for ``attach``) and this process's listeners follow ``endpoints``."""
        self.rt.publish(endpoints, handed=False)
        for listener in list(self.scale_listeners):
            try:
                listener(endpoints, size, drain_timeout_s)
            except Exception:
                logger.exception("scale listener failed")

    def kill_ranks(self) -> None:
        """End every rank now: a broken collective would hold the survivors forever, and a dead rank's
        process may still run (hung, or its step raised), holding its devices."""
        self.rt.kill(list(self.table))

    def end_quietly(self, record: RankRecord) -> None:
        """End one rank's process, unless the cluster closes meanwhile (close ends it); never raises."""
        if self.closing():
            return
        try:
            self.rt.kill([record])
        except Exception:
            logger.warning("ending engine rank %d failed", record.rank, exc_info=True)


__all__ = ["Controls", "Report"]
