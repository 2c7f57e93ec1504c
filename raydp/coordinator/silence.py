"""When the coordinator last heard from each rank, on its own clock: :class:`Silence`.

Every rank says something at least every
:data:`~raydp.engine.loop.ALIVE_EVERY_S` while its loop turns (its load,
changed or not), so a rank silent for long is frozen whole: a stopped
process, or native code holding the GIL, which stop the rank's own
watchdog with its loop. The coordinator only keeps the clock; what the
silence means is the launcher's to judge
(:mod:`raydp.orchestration.silence`).

A rank counts from its first word: one that has not spoken yet (a new rank
still starting, a restarted one) is not silent, since startup has its own
deadline. A death or a restart notice starts the rank's count afresh.
"""

from __future__ import annotations


class Silence:
    """Per rank: when the coordinator last heard from it (None: not yet)."""

    def __init__(self, engine_count: int) -> None:
        self.heard: list[float | None] = [None] * engine_count

    def resize(self, engine_count: int) -> None:
        """Ranks beyond ``engine_count`` go; new ones have not spoken yet."""
        self.heard = (self.heard + [None] * engine_count)[:engine_count]

    def hear(self, rank: int, now: float) -> None:
        if 0 <= rank < len(self.heard):
            self.heard[rank] = now

    def forget(self, rank: int) -> None:
        """The rank died or was replaced: its successor counts from its own first word."""
        if 0 <= rank < len(self.heard):
            self.heard[rank] = None

    def seconds(self, now: float) -> list[float]:
        """Per rank: seconds since its last word (0.0 for one not heard from yet)."""
        return [0.0 if at is None else max(0.0, now - at) for at in self.heard]
