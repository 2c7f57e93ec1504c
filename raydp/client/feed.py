"""What a client hears from its coordinator's publish socket: decoded, logged when malformed, timed.

The router applies a snapshot's content (load, scale and liveness notices);
this keeps what the snapshots themselves leave behind: the last one, when the
coordinator was last heard from (a silent coordinator is probed, then
followed to a successor: :mod:`raydp.client.turns`), and which ranks' whole
cache pictures were asked for lately.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from raydp.errors import ProtocolError
from raydp.wire.control import CacheWanted, StatsSnapshot, snapshot_decoder
from raydp.wire.dropped import DropLog

ASK_EVERY_S = 1.0  # at most one CacheWanted per rank per second: a picture takes a snapshot or two to come


class CoordinatorFeed:
    """One client's view of its coordinator's snapshots; ``ask`` sends a control message to the coordinator,
    ``drops`` counts the malformed messages the client dropped (its engines' too)."""

    def __init__(self, ask: Callable[[CacheWanted], None], drops: DropLog, last_heard: float) -> None:
        self._ask, self._drops = ask, drops
        self.last_snapshot: StatsSnapshot | None = None
        self.last_heard = last_heard
        self._cache_asked: dict[int, float] = {}  # rank -> when this client last asked for its whole picture

    def take(self, frames: list[bytes], sender: str) -> StatsSnapshot | None:
        """The snapshot in ``frames``, or None (dropped and logged as ``sender``'s) if it is malformed."""
        try:
            snap = snapshot_decoder(one_frame(frames))
        except ProtocolError as exc:
            self._drops.drop(sender, str(exc))
            return None
        self.last_snapshot = snap
        self.last_heard = time.monotonic()
        return snap

    def heard(self) -> None:
        """The coordinator answered (or moved): its silence starts again."""
        self.last_heard = time.monotonic()

    def ask_for_pictures(self, ranks: list[int]) -> None:
        """Ask for the whole cache pictures this client fell behind on, each at most once a second."""
        now = time.monotonic()
        for rank in ranks:
            if now - self._cache_asked.get(rank, float("-inf")) >= ASK_EVERY_S:
                self._cache_asked[rank] = now
                self._ask(CacheWanted(rank=rank))


def one_frame(frames: list[bytes]) -> bytes:
    """The body of a message to a client: every one is a single frame."""
    if len(frames) != 1:
        raise ProtocolError(f"a message of {len(frames)} frames (want 1)")
    return frames[0]
