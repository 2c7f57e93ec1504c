"""Restarting a dead coordinator on its node, at its addresses.

The coordinator's state dies with it, but nothing else has to: the engines
keep serving (dense) or stepping the wave they are in (lockstep), and clients
keep routing on their last snapshot. The successor binds the same IPC paths
and TCP ports on the same node, so every engine's and client's ZMQ socket
reconnects on its own and messages sent meanwhile wait in their queues. It
gets what only the orchestrator knows (:class:`~raydp.coordinator.resync.Restored`)
and relearns loads and the wave from the engines (:mod:`raydp.coordinator.resync`).

A coordinator whose node died cannot come back at its addresses: its
successor binds new ones on a live node (the one supervising the cluster),
every running engine is told over the runtime to reconnect to it, this
process's clients follow through :meth:`~raydp.orchestration.reports.DeathReports.coordinator_moved`,
and clients elsewhere (API servers, notebooks), hearing nothing from the old
addresses, ask an engine where it went. A coordinator past
``coordinator_max_restarts`` is dead for good: lockstep ranks stop, dense
ranks keep serving on their last snapshot.
"""

from __future__ import annotations

import logging
import time

from raydp.coordinator.resync import Restored
from raydp.errors import CoordinatorDeadError, DeathCause
from raydp.orchestration.controls import Controls
from raydp.wire.endpoints import CoordinatorEndpoints

logger = logging.getLogger("raydp.manager")


class CoordinatorRestarts:
    """The coordinator's restart policy (callers hold the report lock)."""

    def __init__(self, controls: Controls, max_restarts: int) -> None:
        self.c = controls
        self.left = max_restarts

    def on_death(self, cause: DeathCause, detail: str) -> None:
        c = self.c
        coord = c.state.coordinator
        restarting = self.left > 0 and coord is not None and c.state.endpoints is not None and not c.closing()
        node = coord.node_id if coord is not None else None
        c.reports.died(CoordinatorDeadError(f"of cluster {c.config.name!r}", node, cause, detail, restarting))
        if not restarting:
            if c.config.lockstep:  # no wave could start again: the ranks would wait forever
                c.kill_ranks()
            return
        self.left -= 1
        c.in_background("raydp-coordinator-restart", self.restart, cause is DeathCause.NODE_DIED)

    def restart(self, moved: bool = False) -> None:
        c, started = self.c, time.monotonic()
        try:
            c.rt.kill_coordinator()  # it may be wedged rather than dead; its name must be free
            old, restored = self.restored()
            with c.owned.lock:
                if c.owned.released:
                    return
                new = c.rt.start_coordinator(len(c.table), (old, restored), moved)
            if moved:
                self.follow(new, restored)
            elif new != old:
                raise RuntimeError(f"the successor bound {new}, not its predecessor's {old}")
            live = restored.engine_count - len(restored.dead)
            if not c.rt.wait_subscribed(live, None, []):
                logger.warning(
                    "restarted coordinator: not every live engine resubscribed within %.0fs",
                    c.config.handshake_timeout_s,
                )
            assert c.state.endpoints is not None
            c.rt.publish(c.state.endpoints, handed=True)
        except Exception as exc:
            if c.closing():
                return
            logger.error("the coordinator of cluster %r could not be restarted: %r", c.config.name, exc)
            with c.report_lock:
                self.left = 0
            c.report(-1, DeathCause.INIT_FAILED, f"restart failed: {exc!r}")
            return
        coord = c.state.coordinator
        where = f" on node {coord.node_id[:12]}" if moved and coord is not None else ""
        logger.warning(
            "coordinator of cluster %r restarted%s in %.2fs", c.config.name, where, time.monotonic() - started
        )

    def follow(self, new: CoordinatorEndpoints, restored: Restored) -> None:
        """The successor is elsewhere: the orchestrator, the engines and this process's clients follow it."""
        c = self.c
        endpoints = c.state.replace_coordinator(new)
        old_control, c.reports.coordinator = c.reports.coordinator, c.control(new)
        c.owned.closers.append(c.reports.coordinator.close)
        if old_control is not None:
            old_control.close()
        self.tell_what_changed(restored)
        missed = c.rt.follow_coordinator(list(c.table), new)
        if missed:  # a rank restarting meanwhile joins the new coordinator itself (see DenseRestarts)
            logger.info("ranks %s were not running to follow the coordinator", missed)
        c.reports.coordinator_moved(endpoints)

    def tell_what_changed(self, restored: Restored) -> None:
        """Deaths and restarts reported while the successor started went to its dead predecessor's
        addresses: tell the successor (ranks of the lost node die and restart at the same time)."""
        c, control = self.c, self.c.reports.coordinator
        endpoints = c.state.endpoints
        assert endpoints is not None and control is not None
        with c.report_lock:
            dead = dict(c.reports.dead)
        for ep in endpoints.engines:
            if ep.rank in dead and ep.rank not in restored.dead:
                control.engine_dead(ep.rank, dead[ep.rank])
            elif ep.rank in restored.dead and ep.rank not in dead:
                control.engine_revived(ep.rank, list(ep.input_addresses), ep.node_id)

    def restored(self) -> tuple[CoordinatorEndpoints, Restored]:
        """What only the orchestrator knows: the ranks, which are dead, their addresses and tallies."""
        c = self.c
        endpoints, coordinator = c.state.endpoints, c.state.coordinator
        assert endpoints is not None and coordinator is not None
        reports, n = c.reports, len(c.table)
        with c.report_lock:
            dead = {r: c for r, c in reports.dead.items() if r < n}
            restored = Restored(
                engine_count=n,
                size=n,
                dead=dead,
                moved={ep.rank: list(ep.input_addresses) for ep in endpoints.engines if ep.rank not in dead},
                nodes={ep.rank: ep.node_id for ep in endpoints.engines},
                deaths=[reports.death_counts.get(r, 0) for r in range(n)],
                restarts=[reports.restart_counts.get(r, 0) for r in range(n)],
                hangs=[reports.hang_counts.get(r, 0) for r in range(n)],
                prefill_ranks=endpoints.prefill_ranks or -1,
            )
        return coordinator, restored
