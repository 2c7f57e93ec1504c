"""What a restarted coordinator restores from its launcher and relearns from the engines.

A coordinator's state lives only in its process. When it dies, the launcher
starts a successor on the same node, bound to the same addresses (so every
engine's and client's socket reconnects by itself), and hands it what only
the launcher knows: the rank count, the size clients route to, the dead ranks,
each rank's node and addresses, and the death and restart tallies
(:class:`Restored`). The rest (each rank's load, the wave, whether it runs) is
the engines': the successor broadcasts ``Resync`` until every live rank has
answered with an ``EngineReport`` (:class:`ResyncTracker`), and withholds
snapshots meanwhile, so that no client routes on, or starts a wave from, a
state it has not rebuilt yet.

Pure logic: no Ray, no sockets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

# How long snapshots wait for the engines' reports: a rank that does not
# answer by then (wedged, or its restart is under way) is published as idle.
WITHHOLD_S = 1.0
# How long Resync is repeated for ranks that have not answered.
RESYNC_S = 10.0


class Restored(msgspec.Struct, frozen=True):
    """What the launcher hands a restarted coordinator (travels as a Ray actor argument)."""

    engine_count: int
    size: int
    dead: dict[int, str] = {}
    moved: dict[int, list[str]] = {}
    nodes: dict[int, str] = {}
    deaths: list[int] = []
    restarts: list[int] = []
    hangs: list[int] = []
    prefill_ranks: int = -1  # P/D: the pools' boundary as last moved (-1: as launched)


@dataclass
class ResyncTracker:
    """The ranks a restarted coordinator still waits to hear from, and when to ask again."""

    awaiting: set[int]
    started: float
    interval_s: float
    _last_ask: float = field(default=float("-inf"))

    def answered(self, rank: int) -> None:
        self.awaiting.discard(rank)

    def withholding(self, now: float) -> bool:
        """True while snapshots should wait for more reports."""
        return bool(self.awaiting) and now - self.started < WITHHOLD_S

    def ask_due(self, now: float) -> bool:
        """True when ``Resync`` should be (re)broadcast: PUB/SUB drops it for a rank not yet resubscribed."""
        if not self.awaiting or now - self.started > RESYNC_S or now - self._last_ask < self.interval_s:
            return False
        self._last_ask = now
        return True

    @property
    def done(self) -> bool:
        return not self.awaiting
