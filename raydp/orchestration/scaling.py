"""Growing and shrinking a running cluster (``cluster.scale``), on any backend.

A :class:`ScaleChange` runs one change, in the calling thread, as a sequence
of public steps (the property tests call them one by one, interleaved with
everything else the cluster does). Ranks stay dense (``0..dp_size-1``): a
scale-up adds the next ranks, a scale-down removes the highest.

Scale-up (:meth:`ScaleChange.grow`): place the new ranks on what is free now
(waiting for pending capacity where allowed), build their engines, tell the
coordinator to track them (clients do not route to them yet), run the same
handshake as at launch, wait for their subscriptions, announce their
addresses, and only then let clients route to them. Any failure removes what
it made; the cluster serves on at its old size.

Scale-down (:meth:`ScaleChange.shrink`): clients stop routing to the highest
ranks (this process's clients at once, the others from the next snapshot);
retryable requests with no output yet move off them; the rest drain, bounded
by ``drain_timeout_s``. Then the ranks are retired (their ends are not
deaths), clients drop them (what is still on them fails with
:class:`~raydp.errors.ScaleDownError`), and their engines and placements go.

P/D pools (:mod:`raydp.orchestration.pools`): a change that moves the
boundary between the pools moves it after a scale-up (the new ranks have
joined as decode ranks) and before a scale-down (the ranks that go are
decode ranks by then); if the scale-down fails, the boundary moves back, and
if the boundary does not move after a scale-up, the new ranks go again.

Lockstep: before the DP group changes the gang is held at a wave boundary
(:class:`HoldSteps`, :mod:`raydp.coordinator.hold`), a new rendezvous opens,
every rank re-forms the group at the new size, and the hold is released;
requests that arrive meanwhile wait in the engines and run after it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import Protocol

from raydp.errors import DeathCause, StartupError
from raydp.orchestration.controls import Controls
from raydp.orchestration.ranks import RankRecord
from raydp.wire.endpoints import ClusterEndpoints, EngineEndpoint
from raydp.wire.handshake import HandshakeResult
from raydp.wire.records import CoordinatorStatus as State

logger = logging.getLogger("raydp.manager")
POLL_S = 0.02
_epochs = itertools.count(1)


class CoordinatorControl(Protocol):
    """What a scale change tells the coordinator (a :class:`~raydp.coordinator.client.CoordinatorClient`)."""

    def scale(self, engine_count: int, size: int, prefill: int = -1) -> None: ...
    def hold(self, epoch: int, gang: int) -> None: ...
    def regroup(self, epoch: int, dp_size: int, dp_master: str) -> None: ...
    def release(self, epoch: int) -> None: ...
    def engine_revived(self, rank: int, input_addresses: list[str], node_id: str = "") -> None: ...


class HoldSteps:
    """The launcher's side of holding a lockstep gang while its DP group re-forms at a new size."""

    def __init__(self, coordinator: CoordinatorControl, gang: int) -> None:
        self.coordinator = coordinator
        self.epoch = next(_epochs)
        self.gang = gang

    def hold(self) -> None:
        """Ask for a hold at the next wave boundary; :meth:`frozen` says when it took."""
        self.coordinator.hold(self.epoch, self.gang)

    @staticmethod
    def frozen(state: State) -> bool:
        return state.hold == "frozen"

    def regroup(self, dp_size: int, dp_master: str) -> None:
        self.coordinator.regroup(self.epoch, dp_size, dp_master)

    @staticmethod
    def regrouping(state: State) -> bool:
        return state.hold in ("regrouping", "regrouped")

    @staticmethod
    def regrouped(state: State) -> bool:
        return state.hold == "regrouped"

    def release(self) -> None:
        self.coordinator.release(self.epoch)


class ScaleChange:
    """One scale change of a cluster to ``dp_size`` ranks (the orchestrator runs one at a time).

    ``prefill``: a P/D cluster's new boundary (0: it stays).
    """

    def __init__(self, controls: Controls, dp_size: int, drain_timeout_s: float, prefill: int = 0) -> None:
        coordinator = controls.reports.coordinator
        assert coordinator is not None and controls.state.endpoints is not None, "scale() needs a started cluster"
        self.c = controls
        self.cfg = controls.config
        self.coordinator: CoordinatorControl = coordinator
        self.before = len(controls.table)
        self.target = dp_size
        self.prefill_before = controls.state.prefill_ranks
        self.prefill = prefill or self.prefill_before
        self.drain_timeout_s = drain_timeout_s
        self.new: list[RankRecord] = []
        self.gang: HoldSteps | None = None
        self.joined: HandshakeResult | None = None

    def run(self) -> ClusterEndpoints:
        started = time.monotonic()
        if self.prefill < self.prefill_before:
            self.move_boundary(self.prefill)
        try:
            if self.target > self.before:
                self.grow()
            elif self.target < self.before:
                self.shrink()
        except BaseException:
            if self.prefill < self.prefill_before:
                self.restore_boundary()
            raise
        if self.prefill > self.prefill_before:
            try:
                self.move_boundary(self.prefill)
            except Exception as exc:  # an interrupt is not waited through a drain
                self.give_back_growth(exc)
                raise
        pools = f" ({self.prefill} prefill)" if self.prefill else ""
        logger.info(
            "cluster %r scaled from %d to %d ranks%s in %.2fs%s",
            self.cfg.name,
            self.before,
            self.target,
            pools,
            time.monotonic() - started,
            " (lockstep: the DP group was re-formed)" if self.cfg.lockstep else "",
        )
        assert self.c.state.endpoints is not None
        return self.c.state.endpoints

    # ---- scale-up ---------------------------------------------------------------------

    def grow(self) -> None:
        regrouping = False
        try:
            self.build_new_ranks()
            if self.cfg.lockstep:
                self.hold_gang()
            self.track_new_ranks()
            if self.cfg.lockstep:
                regrouping = True
                self.regroup_gang()
            self.join_new_ranks()
            if self.cfg.lockstep:
                self.release_gang()
        except BaseException as exc:
            self.undo_grow(exc, regrouping)
            raise
        for record in self.new:
            self.announce(record.rank)
        self.open_new_ranks()

    def build_new_ranks(self) -> None:
        """Place the new ranks and build their engines: nothing routes to them yet."""
        c = self.c
        self.new = c.rt.place(range(self.before, self.target), list(c.table), f"scale to dp_size={self.target}")
        c.state.add_ranks(self.new)
        probes = c.rt.probe_devices(self.new)  # resolved by the new ranks as they start
        c.rt.spawn_engines(self.new, probes, successors=True)
        # Built before any hold: a lockstep gang is held only while its group re-forms.
        c.rt.wait_built(self.new)
        for record, devices in zip(self.new, c.rt.resolve_devices(probes), strict=True):
            record.devices = devices

    def track_new_ranks(self) -> None:
        """The coordinator tracks the new ranks; clients still route to the old ones only."""
        self.tell_size(self.target, self.before)

    def join_new_ranks(self) -> None:
        c = self.c
        c.state.grow()
        self.joined = c.rt.join(self.new, c.init_for, watched=list(c.table))
        if not c.rt.wait_subscribed(self.target, None, list(c.table)):
            raise StartupError("engines did not subscribe to the coordinator's broadcast in time")

    def announce(self, rank: int) -> None:
        """A new rank's addresses, for every client (they still do not route to it)."""
        assert self.joined is not None
        record = self.c.table[rank]
        self.coordinator.engine_revived(rank, self.joined.ready[rank].input_addresses, record.node_id)

    def open_new_ranks(self) -> None:
        """Clients route to the new ranks; they are watched and may restart from now on."""
        c = self.c
        assert self.joined is not None and c.state.endpoints is not None
        self.tell_size(self.target, self.target)
        c.budget.grant(r.rank for r in self.new)
        c.rt.watch(self.new)
        added = [EngineEndpoint(r.rank, r.node_id, self.joined.ready[r.rank].input_addresses) for r in self.new]
        c.publish_routes([*c.state.endpoints.engines, *added], self.target, None)

    def undo_grow(self, exc: BaseException, regrouping: bool) -> None:
        c = self.c
        if regrouping:  # the old ranks may be waiting in a group that never forms: the gang is lost
            c.report(0, DeathCause.INIT_FAILED, f"scale failed while re-forming the DP group: {exc!r}")
            return
        self.retire(self.new)
        self.remove_ranks(c.state.abandon_growth(self.before))
        try:
            self.tell_size(self.before, self.before)
        except Exception as undo:  # the coordinator is gone too: its death is reported on its own
            logger.error("scale: could not restore the coordinator's size: %r", undo)
        logger.error("scale to %d ranks failed; the cluster serves on with %d: %r", self.target, self.before, exc)

    # ---- scale-down -------------------------------------------------------------------

    def shrink(self) -> None:
        self.close_routing()
        self.drain()
        if self.cfg.lockstep:
            self.hold_gang()
            self.regroup_gang()
            self.release_gang()
        self.drop_ranks()

    def close_routing(self) -> None:
        """Clients stop routing to the ranks that go; the coordinator still tracks them."""
        assert self.c.state.endpoints is not None
        self.tell_size(self.before, self.target)
        self.c.publish_routes(list(self.c.state.endpoints.engines), self.target, None)

    def drain(self) -> None:
        """Wait until nothing is in flight on the ranks that go, or ``drain_timeout_s`` passes.

        At least a few stats intervals pass first, so that clients in other
        processes have seen the new size and what they sent just before it
        has arrived.
        """
        gone = list(range(self.target, self.before))
        started = time.monotonic()
        settle = started + 2 * self.cfg.stats_interval_s + 0.05
        while True:
            left = self.c.rt.in_flight(gone)
            now = time.monotonic()
            if left == 0 and now >= settle:
                return
            if now - started >= self.drain_timeout_s:
                logger.warning(
                    "scale-down: %d requests still on ranks %s after the %gs drain timeout; "
                    "they fail with ScaleDownError",
                    left,
                    gone,
                    self.drain_timeout_s,
                )
                return
            time.sleep(POLL_S * 2)

    def drop_ranks(self) -> None:
        """The ranks that go are retired, dropped by every client, then ended."""
        c = self.c
        assert c.state.endpoints is not None
        self.retire([c.table[r] for r in range(self.target, self.before)])
        engines = list(c.state.endpoints.engines[: self.target])
        gone = c.state.shrink(self.target)
        self.tell_size(self.target, self.target)
        c.publish_routes(engines, self.target, self.drain_timeout_s)
        self.remove_ranks(gone)

    # ---- P/D pools ---------------------------------------------------------------------

    def move_boundary(self, prefill: int) -> None:
        """Ranks ``0..prefill-1`` prefill from now on: the coordinator's snapshots carry it to every client.

        The coordinator is told first, with the sizes it already has, and the
        state and this process's clients follow once it applied the move: a
        move that times out changes nothing here.
        """
        c = self.c
        now = c.rt.coordinator_state()
        if not 0 < prefill < now.routable:
            raise ValueError(f"prefill_ranks={prefill}: the coordinator routes to {now.routable} ranks")
        self.coordinator.scale(now.dp_size, now.routable, prefill)
        self.wait_state(lambda s: s.prefill_ranks == prefill, f"the coordinator to move the pools to {prefill}")
        c.publish(c.state.move_boundary(prefill), now.routable, None)
        logger.info("cluster %r: ranks 0..%d prefill, the others decode", self.cfg.name, prefill - 1)

    def give_back_growth(self, exc: Exception) -> None:
        """A prefill pool grew, but the boundary did not move: the ranks it added, decode ranks until the
        move, go again (drained as any scale-down), so the cluster is as it was rather than a decode
        rank bigger than anyone asked for."""
        if self.c.closing() or self.target <= self.before:
            return
        logger.error("scale: the pools' boundary did not move to %d (%r); the new ranks go again", self.prefill, exc)
        try:
            # The move may still reach the coordinator (it timed out here, not there), and its boundary
            # would then outgrow the smaller size: the old one follows it on the same channel.
            now = self.c.rt.coordinator_state()
            self.coordinator.scale(now.dp_size, now.routable, self.prefill_before)
            ScaleChange(self.c, self.before, self.drain_timeout_s).run()
        except Exception as undo:  # the coordinator is gone too: its death is reported on its own
            logger.error("scale: giving the %d new ranks back failed: %r", self.target - self.before, undo)

    def restore_boundary(self) -> None:
        """A prefill pool's shrink failed: its ranks prefill again, where the ranks still routed to allow it."""
        if self.c.closing():  # the change failed because the cluster is closing: nothing serves on
            return
        try:
            self.move_boundary(self.prefill_before)
        except Exception as exc:  # the shrink got past closing the ranks, or the coordinator is gone
            logger.error(
                "scale: the pools stay at %d prefill ranks, not %d: %r", self.prefill, self.prefill_before, exc
            )

    # ---- shared steps -----------------------------------------------------------------

    def retire(self, records: list[RankRecord]) -> None:
        """From here on, the ends of ``records`` are a scale change, not deaths to report or restart."""
        c = self.c
        with c.report_lock:
            c.rt.retire(records)
            for record in records:
                c.budget.forget(record.rank)

    def remove_ranks(self, records: list[RankRecord]) -> None:
        """End ``records`` (retired ranks the state no longer holds) and remove their placements."""
        if records:
            self.c.rt.stop_engines(records)
            self.c.rt.remove_groups(records)

    def tell_size(self, engine_count: int, size: int) -> None:
        """Tell the coordinator, and wait until it has applied it (its PUSH is fire-and-forget)."""
        self.coordinator.scale(engine_count, size)
        self.wait_state(
            lambda s: s.dp_size == engine_count and s.routable == size, f"the coordinator to track {engine_count} ranks"
        )

    def hold_gang(self) -> None:
        self.gang = HoldSteps(self.coordinator, self.before)
        self.gang.hold()
        self.wait_state(HoldSteps.frozen, "the lockstep gang to be frozen")

    def regroup_gang(self) -> None:
        c = self.c
        assert self.gang is not None
        master = c.rt.dp_master(self.target, list(c.table)[: min(self.before, self.target)])
        c.state.advance_wave(c.rt.coordinator_state().wave)
        c.state.rendezvous_at(master)
        self.gang.regroup(self.target, master)
        self.wait_state(HoldSteps.regrouping, "the coordinator to start the regroup")

    def release_gang(self) -> None:
        assert self.gang is not None
        self.wait_state(HoldSteps.regrouped, "the lockstep gang to be regrouped")
        self.gang.release()

    def wait_state(self, done: Callable[[State], bool], what: str) -> None:
        deadline = time.monotonic() + self.cfg.handshake_timeout_s
        while not done(self.c.rt.coordinator_state()):
            if self.c.closing():
                raise StartupError(f"cluster {self.cfg.name!r} is closing")
            if time.monotonic() > deadline:
                raise StartupError(f"scale: timed out after {self.cfg.handshake_timeout_s:g}s waiting for {what}")
            time.sleep(POLL_S)
