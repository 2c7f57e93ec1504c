"""Restarting a dead coordinator on its node, at its addresses.

The coordinator's state dies with it, but nothing else has to: the engines
keep serving (dense) or stepping the wave they are in (lockstep), and clients
keep routing on their last snapshot. The successor binds the same IPC paths
and TCP ports on the same node, so every engine's and client's ZMQ socket
reconnects on its own and messages sent meanwhile wait in their queues. It
gets what only the orchestrator knows (:class:`~raydp.coordinator.resync.Restored`)
and relearns loads and the wave from the engines (:mod:`raydp.coordinator.resync`).

A coordinator whose node died cannot come back at its addresses, and is not
restarted (its node is rank 0's, so that rank is being re-placed too). Neither
is one past ``coordinator_max_restarts``. Then the cluster reports it dead for
good: lockstep ranks stop, dense ranks keep serving on their last snapshot.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from raydp.coordinator.resync import Restored
from raydp.errors import CoordinatorDeadError, DeathCause
from raydp.wire.endpoints import CoordinatorEndpoints

if TYPE_CHECKING:
    from raydp.orchestration.core import Orchestrator

logger = logging.getLogger("raydp.manager")


class CoordinatorRestarts:
    """The coordinator's restart policy (callers hold the orchestrator's report lock)."""

    def __init__(self, orchestrator: Orchestrator, max_restarts: int) -> None:
        self.o = orchestrator
        self.left = max_restarts

    def on_death(self, cause: DeathCause, detail: str) -> None:
        o = self.o
        coord = o.coordinator_endpoints
        restarting = (
            self.left > 0
            and cause is not DeathCause.NODE_DIED
            and coord is not None
            and o.endpoints is not None
            and not o.closing()
        )
        node = coord.node_id if coord is not None else None
        o.reports.died(CoordinatorDeadError(f"of cluster {o.config.name!r}", node, cause, detail, restarting))
        if not restarting:
            if o.config.lockstep:  # no wave could start again: the ranks would wait forever
                o.kill_ranks(except_rank=-1)
            return
        self.left -= 1
        o.in_background("raydp-coordinator-restart", self.restart)

    def restart(self) -> None:
        o, started = self.o, time.monotonic()
        try:
            o.rt.kill_coordinator()  # it may be wedged rather than dead; its name must be free
            old, restored = self.restored()
            with o.owned.lock:
                if o.owned.released:
                    return
                new = o.rt.start_coordinator(len(o.table), (old, restored))
            if new != old:
                raise RuntimeError(f"the successor bound {new}, not its predecessor's {old}")
            live = restored.engine_count - len(restored.dead)
            if not o.rt.wait_subscribed(live, None, []):
                logger.warning(
                    "restarted coordinator: not every live engine resubscribed within %.0fs",
                    o.config.handshake_timeout_s,
                )
            assert o.endpoints is not None
            o.rt.publish(o.endpoints, handed=True)
        except Exception as exc:
            if o.closing():
                return
            logger.error("the coordinator of cluster %r could not be restarted: %r", o.config.name, exc)
            with o.report_lock:
                self.left = 0
            o.report(-1, DeathCause.INIT_FAILED, f"restart failed: {exc!r}")
            return
        logger.warning("coordinator of cluster %r restarted in %.2fs", o.config.name, time.monotonic() - started)

    def restored(self) -> tuple[CoordinatorEndpoints, Restored]:
        """What only the orchestrator knows: the ranks, which are dead, their addresses and tallies."""
        o = self.o
        assert o.endpoints is not None and o.coordinator_endpoints is not None
        reports, n = o.reports, len(o.table)
        with o.report_lock:
            dead = {r: c for r, c in reports.dead.items() if r < n}
            restored = Restored(
                engine_count=n,
                size=n,
                dead=dead,
                moved={ep.rank: list(ep.input_addresses) for ep in o.endpoints.engines if ep.rank not in dead},
                nodes={ep.rank: ep.node_id for ep in o.endpoints.engines},
                deaths=[reports.death_counts.get(r, 0) for r in range(n)],
                restarts=[reports.restart_counts.get(r, 0) for r in range(n)],
            )
        return o.coordinator_endpoints, restored
