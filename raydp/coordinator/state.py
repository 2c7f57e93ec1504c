"""The coordinator's state machine: per-rank load, the wave, the running flag, the size.

Pure logic, no Ray and no sockets. :class:`CoordinatorState` takes the messages
of :mod:`raydp.wire.control` addressed to the coordinator and returns the
broadcast to send to engines, if any; :meth:`CoordinatorState.due_snapshot`
decides when to publish to clients (at most once per stats interval when
something changed, a heartbeat otherwise), :meth:`CoordinatorState.due_broadcasts`
what to repeat to engines (PUB/SUB may drop a message).

Scaling (``ScaleEngines``) changes how many ranks it tracks and how many
clients route to; a lockstep change also holds the gang
(:mod:`raydp.coordinator.hold`) while its DP group is re-formed. What each
rank's prefix cache holds is kept in :mod:`raydp.coordinator.cache` and
published with the snapshots.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from raydp.coordinator.cache import CachePictures
from raydp.coordinator.hold import GangHold
from raydp.coordinator.publish import describe, snapshot
from raydp.coordinator.resync import WITHHOLD_S, Restored, ResyncTracker
from raydp.errors import DeathCause
from raydp.wire.adapters import AdapterState
from raydp.wire.control import (
    AdapterReport,
    CacheReport,
    CacheWanted,
    EngineDead,
    EngineReport,
    EngineRevived,
    EngineStats,
    FirstRequest,
    HoldAck,
    HoldCluster,
    RegroupCluster,
    Regrouped,
    ReleaseCluster,
    Resync,
    ScaleEngines,
    StartDPWave,
    StartWave,
    StatsSnapshot,
    ToCoordinator,
    ToEngines,
    WaveComplete,
)
from raydp.wire.records import CoordinatorStatus

logger = logging.getLogger("raydp.coordinator")
# Tuples, not ``A | B``: that expression builds a union object on every message.
_STARTS = (FirstRequest, StartWave)
_HOLDING = (HoldCluster, HoldAck, RegroupCluster, Regrouped, ReleaseCluster)


@dataclass
class CoordinatorState:
    """Load and wave bookkeeping for ``engine_count`` ranks."""

    engine_count: int
    stats_interval_s: float = 0.1
    heartbeat_interval_s: float = 1.0
    wave: int = 0
    running: bool = False
    counts: list[list[int]] = field(default_factory=list)
    work: list[int] = field(default_factory=list)  # per rank: tokens left to generate, -1 unknown
    changed: bool = True
    dead: dict[int, str] = field(default_factory=dict)
    moved: dict[int, list[str]] = field(default_factory=dict)
    deaths: list[int] = field(default_factory=list)  # per rank, for operators (raydp status, metrics)
    restarts: list[int] = field(default_factory=list)
    hangs: list[int] = field(default_factory=list)  # deaths whose cause was a hang
    rejected: int = 0
    size: int = -1  # ranks clients route new requests to; the rest drain (-1: all)
    prefill_ranks: int = -1  # P/D: the pools' boundary as last moved (-1: as launched)
    nodes: dict[int, str] = field(default_factory=dict)  # node of each rank in ``moved``
    hold: GangHold | None = None
    resync: ResyncTracker | None = None  # a restarted coordinator relearning the engines' state
    cache: CachePictures = field(default_factory=lambda: CachePictures(0))
    adapters: list[AdapterState] = field(default_factory=list)  # per rank: the LoRA adapters it holds
    _last_publish: float = float("-inf")
    _last_wave_broadcast: float = float("-inf")
    _last_hold_broadcast: float = float("-inf")
    _released_epoch: int = -1
    _seq: int = 0

    def __post_init__(self) -> None:
        self._resize(self.engine_count)
        if self.size < 0:
            self.size = self.engine_count

    def _resize(self, n: int) -> None:
        """Per-rank lists for ``n`` ranks: existing ranks keep theirs, new ones start at zero."""
        self.counts = (self.counts + [[0, 0] for _ in range(n)])[:n]
        self.work = (self.work + [-1] * n)[:n]
        self.deaths = (self.deaths + [0] * n)[:n]
        self.restarts = (self.restarts + [0] * n)[:n]
        self.hangs = (self.hangs + [0] * n)[:n]
        self.adapters = (self.adapters + [AdapterState() for _ in range(n)])[:n]
        self.cache.resize(n)
        for table in (self.dead, self.moved, self.nodes):
            for rank in [r for r in table if r >= n]:  # a removed rank's notices go with it
                del table[rank]
        self.engine_count = n

    def restore(self, restored: Restored, now: float) -> None:
        """Start as the successor of a dead coordinator: the launcher's part now, the engines' by resync.

        See :mod:`raydp.coordinator.resync`.
        """
        n = restored.engine_count
        self._resize(n)
        self.size = restored.size if 1 <= restored.size <= n else n
        self.prefill_ranks = restored.prefill_ranks if 0 < restored.prefill_ranks < n else -1
        self.dead = {r: c for r, c in restored.dead.items() if 0 <= r < n}
        self.moved = {r: list(a) for r, a in restored.moved.items() if 0 <= r < n}
        self.nodes = {r: node for r, node in restored.nodes.items() if 0 <= r < n}
        self.deaths = (list(restored.deaths) + [0] * n)[:n]
        self.restarts = (list(restored.restarts) + [0] * n)[:n]
        self.hangs = (list(restored.hangs) + [0] * n)[:n]
        self.resync = ResyncTracker(set(range(n)) - set(self.dead), now, self.stats_interval_s)
        self.changed = True

    def handle(self, msg: ToCoordinator) -> ToEngines | None:
        """Apply one message; return the broadcast it calls for, if any."""
        if isinstance(msg, EngineStats):  # nearly all the traffic (every rank, every interval): first
            self._on_stats(msg)
            return None
        if isinstance(msg, EngineReport):
            return self._on_report(msg)
        if isinstance(msg, (CacheReport, CacheWanted)):
            self._on_cache(msg)
            return None
        if isinstance(msg, AdapterReport):
            self._on_adapters(msg)
            return None
        if isinstance(msg, _STARTS) and self.hold is not None:
            return self._start_during_hold(self.hold, msg)
        if isinstance(msg, FirstRequest):
            return self._on_first_request(msg)
        if isinstance(msg, StartWave):
            return self._on_start_wave(msg)
        if isinstance(msg, _HOLDING):
            return self._on_hold(msg)
        if isinstance(msg, WaveComplete):
            self._on_wave_complete(msg)
        elif isinstance(msg, ScaleEngines):
            self._on_scale(msg)
        else:
            self._on_liveness(msg)
        return None

    # ---- holding a lockstep gang (scale changes) -----------------------------------

    def _on_hold(self, msg: HoldCluster | HoldAck | RegroupCluster | Regrouped | ReleaseCluster) -> ToEngines | None:
        if isinstance(msg, HoldCluster):
            if not 1 <= msg.gang <= self.engine_count:
                self.rejected += 1
                logger.warning("coordinator: dropped %r: gang must be in [1, %d]", msg, self.engine_count)
                return None
            self.hold = GangHold(msg.epoch, msg.gang, woke_wave=self.wave if self.running else -1)
            self.changed = True
            return self.hold.hold_message()
        hold = self.hold
        if hold is None and isinstance(msg, HoldAck | Regrouped) and msg.epoch <= self._released_epoch:
            return None  # a late answer to a repeated Hold or Regroup of a change that is over
        if hold is None or msg.epoch != hold.epoch:
            self.rejected += 1
            logger.warning("coordinator: dropped %r: no hold of that epoch is in progress", msg)
            return None
        if isinstance(msg, HoldAck):
            return self._on_hold_ack(hold, msg)
        if isinstance(msg, Regrouped):
            hold.on_regrouped(msg.rank, msg.epoch)
            return None
        if isinstance(msg, RegroupCluster):
            regroup = hold.start_regroup(msg.dp_size, msg.dp_master)
            if regroup is None:
                self.rejected += 1
                logger.warning("coordinator: dropped %r: the gang is not frozen yet", msg)
            return regroup
        return self._release(hold)

    def _start_during_hold(self, hold: GangHold, msg: FirstRequest | StartWave) -> StartDPWave | None:
        """A wave start asked for while the gang is held.

        Until the gang is frozen, the sender's target may already be stepping
        alone towards the all-reduce (it got the request before the Hold), and
        once there it cannot read the Hold to ack it: wake the gang into the
        wave, as for a rank that acks running, and wait for everyone to pause
        past it. Once frozen nobody steps: the start waits for the release.
        """
        if hold.phase() != "holding":
            if not self._bad_rank(msg.rank, msg):
                hold.deferred_start = True
            return None
        wake = self._on_first_request(msg) if isinstance(msg, FirstRequest) else self._on_start_wave(msg)
        if wake is not None:
            hold.woke_wave = max(hold.woke_wave, wake.wave)
        return wake

    def _on_hold_ack(self, hold: GangHold, msg: HoldAck) -> StartDPWave | None:
        wake = hold.on_ack(msg)
        if wake is None or wake < self.wave:
            return None  # a rank of a wave that already completed: it is pausing
        self.wave, self.running, self.changed = wake, True, True
        return StartDPWave(wave=wake, exclude=-1)

    def _release(self, hold: GangHold) -> ToEngines:
        self.hold = None
        self._released_epoch = max(self._released_epoch, hold.epoch)
        self.changed = True
        if hold.deferred_start or any(w or r for w, r in self.counts):
            self.running = True
            self._last_wave_broadcast = float("-inf")  # due_broadcasts starts the wave right away
        return hold.release()

    def status(self, *, dropped: int = 0, broadcasts: int = 0, subscribed: Iterable[int] = ()) -> CoordinatorStatus:
        """This state as the coordinator describes it (:func:`raydp.coordinator.publish.describe`)."""
        return describe(self, dropped=dropped, broadcasts=broadcasts, subscribed=subscribed)

    def hold_phase(self) -> str | None:
        return self.hold.phase() if self.hold is not None else None

    def due_broadcasts(self, now: float) -> list[ToEngines]:
        """What to (re)send to engines at ``now``: the running wave, an unanswered Hold or Regroup."""
        out: list[ToEngines] = []
        if self.resync is not None and self.resync.ask_due(now):
            out.append(Resync())
        wave = self.due_rebroadcast(now)
        if wave is not None:
            out.append(wave)
        hold = self.hold
        if hold is None or now - self._last_hold_broadcast < self.heartbeat_interval_s:
            return out
        if hold.regroup is None and hold.unacked():
            out.append(hold.hold_message())
        elif hold.regroup is not None and hold.phase() == "regrouping":
            out.append(hold.regroup)
        else:
            return out
        self._last_hold_broadcast = now
        return out

    def _on_liveness(self, msg: EngineDead | EngineRevived) -> None:
        if self._bad_rank(msg.rank, msg):
            return
        if isinstance(msg, EngineDead):
            # The same death may be reported twice (the launcher and a client both see it): only the first
            # notice forgets the rank, since a replacement may have reported between the two.
            if msg.rank not in self.dead:
                self.deaths[msg.rank] += 1
                self.hangs[msg.rank] += msg.cause == DeathCause.HUNG.value
                self.cache.forget(msg.rank)
                self.adapters[msg.rank] = AdapterState()  # a dead engine holds nothing; its successor reports anew
                self.counts[msg.rank] = [0, 0]
                self.work[msg.rank] = min(self.work[msg.rank], 0)
            self.dead[msg.rank] = msg.cause
        elif not msg.input_addresses or not all(a.startswith(("ipc://", "tcp://")) for a in msg.input_addresses):
            self.rejected += 1
            logger.warning("coordinator: dropped EngineRevived with bad addresses %r", msg.input_addresses)
            return
        else:
            self.dead.pop(msg.rank, None)
            self.moved[msg.rank] = list(msg.input_addresses)
            if msg.node_id:
                self.nodes[msg.rank] = msg.node_id
            if msg.rank < self.size:  # a rank joining in a scale-up is not a restart
                self.restarts[msg.rank] += 1
        self.changed = True

    def due_rebroadcast(self, now: float) -> StartDPWave | None:
        """While running, repeat START_DP_WAVE every heartbeat: PUB/SUB may drop one.

        Engines ignore a wave they already finished, so a repeat is harmless.
        """
        if not self.running or now - self._last_wave_broadcast < self.heartbeat_interval_s:
            return None
        self._last_wave_broadcast = now
        return StartDPWave(wave=self.wave, exclude=-1)

    def note_broadcast(self, now: float) -> None:
        self._last_wave_broadcast = now

    def _on_stats(self, msg: EngineStats) -> None:
        if self._bad_rank(msg.rank, msg):
            return
        new = [max(0, msg.waiting), max(0, msg.running)]
        work = max(-1, msg.work)
        if self.counts[msg.rank] != new or self.work[msg.rank] != work:
            self.counts[msg.rank], self.work[msg.rank] = new, work
            self.changed = True

    def _on_cache(self, msg: CacheReport | CacheWanted) -> None:
        if self._bad_rank(msg.rank, msg):
            return
        if isinstance(msg, CacheWanted):
            self.cache.want(msg.rank)
        else:  # also from a rank reported dead: its replacement may speak before the launcher says so
            self.cache.report(msg)
        self.changed = True

    def _on_adapters(self, msg: AdapterReport) -> None:
        if self._bad_rank(msg.rank, msg):
            return
        # Also from a rank reported dead: its replacement may speak before the launcher says so.
        if self.adapters[msg.rank] != msg.state:
            self.adapters[msg.rank] = msg.state
            self.changed = True

    def _on_report(self, msg: EngineReport) -> StartDPWave | None:
        """A rank's whole state, for a restarted coordinator: its load, and its wave position.

        A stepping rank may be waiting in the collective for peers that are
        paused: it is treated as a ``StartWave``, which wakes them. A paused
        rank waits for ``wave``, so every wave before it is complete.
        """
        if self._bad_rank(msg.rank, msg):
            return None
        if self.resync is not None:
            self.resync.answered(msg.rank)
        self._on_stats(EngineStats(rank=msg.rank, waiting=msg.waiting, running=msg.running, work=msg.work))
        if msg.stepping:
            return self._on_start_wave(StartWave(rank=msg.rank, wave=msg.wave))
        if msg.wave > self.wave:
            self.wave, self.running, self.changed = msg.wave, False, True
        return None

    def _on_first_request(self, msg: FirstRequest) -> StartDPWave | None:
        if self._bad_rank(msg.rank, msg) or self.running:
            return None
        # A stale sender's target may be paused in a later wave: wake everyone.
        exclude = msg.rank if msg.wave >= self.wave else -1
        self.running = True
        self.changed = True
        return StartDPWave(wave=self.wave, exclude=exclude)

    def _on_wave_complete(self, msg: WaveComplete) -> None:
        if msg.wave >= self.wave:
            self.wave = msg.wave + 1
            self.running = False
            self.changed = True

    def _on_start_wave(self, msg: StartWave) -> StartDPWave | None:
        if self._bad_rank(msg.rank, msg):
            return None
        if msg.wave > self.wave or (msg.wave == self.wave and not self.running):
            self.wave = msg.wave
            self.running = True
            self.changed = True
            return StartDPWave(wave=msg.wave, exclude=msg.rank)
        return None

    def _on_scale(self, msg: ScaleEngines) -> None:
        n = msg.engine_count
        size = n if msg.size == -1 else msg.size
        prefill = self.prefill_ranks if msg.prefill == -1 else msg.prefill  # a kept one must leave a decode rank
        if n < 1 or not 1 <= size <= n or not (prefill == -1 or 0 < prefill < size):
            self.rejected += 1
            need = "engine_count >= 1, 1 <= size <= engine_count, the prefill ranks (kept or new) in [1, size)"
            return logger.warning("coordinator: dropped %r: need %s", msg, need)
        if n != self.engine_count or size != self.size:
            logger.info("coordinator: %d ranks, routing to %d (was %d, %d)", n, size, self.engine_count, self.size)
        if msg.prefill not in (-1, self.prefill_ranks):
            logger.info("coordinator: ranks 0..%d prefill, the others decode", msg.prefill - 1)
            self.prefill_ranks = msg.prefill
        self._resize(n)
        self.size = size
        self.changed = True

    def _bad_rank(self, rank: int, msg: ToCoordinator) -> bool:
        if 0 <= rank < self.engine_count:
            return False
        self.rejected += 1
        logger.warning("coordinator: dropped %s for unknown rank %d", type(msg).__name__, rank)
        return True

    def due_snapshot(self, now: float) -> StatsSnapshot | None:
        """The snapshot to publish at ``now``, or None if it is not time yet."""
        if self.resync is not None and self.resync.withholding(now):
            return None
        since = now - self._last_publish
        self.changed = self.changed or self.cache.pending(now)  # e.g. a whole picture held back a second
        if not ((self.changed and since >= self.stats_interval_s) or since >= self.heartbeat_interval_s):
            return None
        self._last_publish = now
        self.changed = False
        self._seq += 1
        return snapshot(self, self._seq, now)

    def next_deadline(self, now: float) -> float:
        """Seconds until :meth:`due_snapshot` may return something."""
        if self.resync is not None and self.resync.withholding(now):
            return min(self.stats_interval_s, WITHHOLD_S)  # also when to ask the silent ranks again
        wait = self.stats_interval_s if self.changed else self.heartbeat_interval_s
        return max(0.0, self._last_publish + wait - now)
