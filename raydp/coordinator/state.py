"""The coordinator's state machine: per-rank load, the wave, the running flag.

Pure logic, no Ray and no sockets. :class:`CoordinatorState` takes the messages
of :mod:`raydp.wire.protocol` addressed to the coordinator and returns the
``StartDPWave`` broadcast to send, if any; :meth:`CoordinatorState.due_snapshot`
decides when to publish to clients (at most once per stats interval when
something changed, a heartbeat otherwise).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from raydp.wire.protocol import (
    EngineDead,
    EngineRevived,
    EngineStats,
    FirstRequest,
    ScaleEngines,
    StartDPWave,
    StartWave,
    StatsSnapshot,
    ToCoordinator,
    WaveComplete,
)

logger = logging.getLogger("raydp.coordinator")

@dataclass
class CoordinatorState:
    """Load and wave bookkeeping for ``engine_count`` ranks."""

    engine_count: int
    stats_interval_s: float = 0.1
    heartbeat_interval_s: float = 1.0
    wave: int = 0
    running: bool = False
    counts: list[list[int]] = field(default_factory=list)
    changed: bool = True
    dead: dict[int, str] = field(default_factory=dict)
    moved: dict[int, list[str]] = field(default_factory=dict)
    deaths: list[int] = field(default_factory=list)  # per rank, for operators (raydp status, metrics)
    restarts: list[int] = field(default_factory=list)
    rejected: int = 0
    _last_publish: float = float("-inf")
    _last_wave_broadcast: float = float("-inf")
    _seq: int = 0

    def __post_init__(self) -> None:
        self._resize(self.engine_count)

    def _resize(self, n: int) -> None:
        """Per-rank lists for ``n`` ranks: existing ranks keep theirs, new ones start at zero."""
        self.counts = (self.counts + [[0, 0] for _ in range(n)])[:n]
        self.deaths = (self.deaths + [0] * n)[:n]
        self.restarts = (self.restarts + [0] * n)[:n]
        self.engine_count = n

    def handle(self, msg: ToCoordinator) -> StartDPWave | None:
        """Apply one message; return the broadcast it calls for, if any."""
        if isinstance(msg, FirstRequest):
            return self._on_first_request(msg)
        if isinstance(msg, StartWave):
            return self._on_start_wave(msg)
        if isinstance(msg, EngineStats):
            self._on_stats(msg)
        elif isinstance(msg, WaveComplete):
            self._on_wave_complete(msg)
        elif isinstance(msg, ScaleEngines):
            self._on_scale(msg)
        else:
            self._on_liveness(msg)
        return None

    def _on_liveness(self, msg: EngineDead | EngineRevived) -> None:
        if self._bad_rank(msg.rank, msg):
            return
        if isinstance(msg, EngineDead):
            if msg.rank not in self.dead:  # the same death may be reported twice
                self.deaths[msg.rank] += 1
            self.dead[msg.rank] = msg.cause
            self.counts[msg.rank] = [0, 0]
        elif not msg.input_addresses or not all(a.startswith(("ipc://", "tcp://")) for a in msg.input_addresses):
            self.rejected += 1
            logger.warning("coordinator: dropped EngineRevived with bad addresses %r", msg.input_addresses)
            return
        else:
            self.dead.pop(msg.rank, None)
            self.moved[msg.rank] = list(msg.input_addresses)
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
        if self.counts[msg.rank] != new:
            self.counts[msg.rank] = new
            self.changed = True

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
        if msg.engine_count < 1:
            self.rejected += 1
            logger.warning("coordinator: dropped ScaleEngines(engine_count=%d): must be >= 1", msg.engine_count)
            return
        n = msg.engine_count
        self._resize(n)
        self.changed = True

    def _bad_rank(self, rank: int, msg: ToCoordinator) -> bool:
        if 0 <= rank < self.engine_count:
            return False
        self.rejected += 1
        logger.warning("coordinator: dropped %s for unknown rank %d", type(msg).__name__, rank)
        return True

    def due_snapshot(self, now: float) -> StatsSnapshot | None:
        """The snapshot to publish at ``now``, or None if it is not time yet."""
        since = now - self._last_publish
        if not ((self.changed and since >= self.stats_interval_s) or since >= self.heartbeat_interval_s):
            return None
        self._last_publish = now
        self.changed = False
        self._seq += 1
        return StatsSnapshot(
            counts=[(w, r) for w, r in self.counts],
            wave=self.wave,
            running=self.running,
            seq=self._seq,
            dead=dict(self.dead),
            moved={r: list(a) for r, a in self.moved.items()},
        )

    def next_deadline(self, now: float) -> float:
        """Seconds until :meth:`due_snapshot` may return something."""
        wait = self.stats_interval_s if self.changed else self.heartbeat_interval_s
        return max(0.0, self._last_publish + wait - now)
