"""The coordinator's picture of what each rank's prefix cache holds, and the changes it publishes.

Engines report their cache's events (:class:`~raydp.wire.control.CacheReport`);
the coordinator keeps each rank's blocks and hands every client the same
picture through its snapshots: per rank, numbered changes
(:class:`~raydp.wire.control.CacheChange`), merged between two snapshots, and
the whole picture for a client that missed one (it sends
:class:`~raydp.wire.control.CacheWanted`; whole pictures of a rank go out at
most once a second). One publisher and one numbering, named by a random
``epoch`` per coordinator, is what lets N API servers agree on which rank
holds a prefix.

From the engines' side, each report names its engine process (its
*incarnation*) and is numbered. A delta out of sequence, or from an
incarnation this picture does not follow, means a report was lost: the
coordinator asks that engine for its whole cache (``SendCache``, on the
rank's own topic). A whole report from a new incarnation replaces the
picture (a restarted rank); reports from a retired one (a dead engine's last
words) are dropped, whichever of its death notice and its replacement's
first report arrives first.

A rank's picture is bounded (``max_blocks``; past it new blocks go
unrecorded, so that the prefixes a busy engine keeps hot are not the ones
forgotten), emptied when the rank dies, and dropped with the rank on a
scale-down.
"""

from __future__ import annotations

import logging
import secrets
from collections import deque
from dataclasses import dataclass, field

from raydp.wire.control import CacheChange, CacheReport

logger = logging.getLogger("raydp.coordinator")
DEFAULT_MAX_BLOCKS = 1 << 17  # per rank: ~1 MiB of digests in the picture, more than most engines' caches
WHOLE_GAP_S = 1.0  # a rank's whole picture goes to clients (or is asked of its engine) at most this often
RETIRED_KEPT = 8  # incarnations remembered per rank, so that a dead engine's late reports are known


@dataclass
class _RankPicture:
    blocks: dict[int, None] = field(default_factory=dict)
    version: int = 0  # of the last published change
    block_size: int = 0
    stored: dict[int, None] = field(default_factory=dict)  # since the last published change
    removed: set[int] = field(default_factory=set)
    whole: bool = False  # the next change is the whole picture
    whole_at: float = float("-inf")
    queried: int = 0
    hits: int = 0
    incarnation: int = 0  # the engine process this picture follows (0: none yet)
    seq: int = 0  # of its last report taken
    retired: deque[int] = field(default_factory=lambda: deque(maxlen=RETIRED_KEPT))
    replaced: bool = False  # a new incarnation took over before the old one's death was reported
    ask: bool = False  # the engine owes a whole report
    asked_at: float = float("-inf")

    def store(self, digest: int, cap: int) -> None:
        if digest in self.blocks or len(self.blocks) < cap:
            self.blocks[digest] = None
            self.removed.discard(digest)
            self.stored[digest] = None

    def remove(self, digest: int) -> None:
        if digest in self.blocks:
            del self.blocks[digest]
            self.stored.pop(digest, None)
            self.removed.add(digest)  # clients may have it from an earlier change

    def clear(self) -> None:
        self.blocks.clear()
        self.stored.clear()
        self.removed.clear()
        self.queried = self.hits = 0
        self.whole = True

    def retire(self) -> None:
        if self.incarnation:
            self.retired.append(self.incarnation)
        self.incarnation, self.seq = 0, 0

    def pending(self, now: float) -> bool:
        if self.whole:
            return now - self.whole_at >= WHOLE_GAP_S or self.version == 0
        return bool(self.stored) or bool(self.removed)


class CachePictures:
    """Per-rank cache pictures for ``engine_count`` ranks; see the module docstring."""

    def __init__(self, engine_count: int, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self.epoch = secrets.randbits(62) + 1
        self.block_size = 0  # the cluster's, from the first report; a report at another size is refused
        self._ranks: list[_RankPicture] = []
        self.reported = False  # some engine reports its cache: snapshots carry hit counts
        self.refused = 0
        self.resize(engine_count)

    def resize(self, n: int) -> None:
        """``n`` ranks: a removed rank's picture goes with it, a new rank starts empty."""
        self._ranks = (self._ranks + [_RankPicture() for _ in range(n)])[:n]

    def report(self, msg: CacheReport) -> None:
        """Take one engine report (the rank is known valid)."""
        picture, events = self._ranks[msg.rank], msg.events
        if not self._fits(msg):
            return
        if msg.incarnation in picture.retired:
            return  # a dead engine's last words
        if msg.incarnation != picture.incarnation:
            if not events.full:
                picture.ask = True  # a delta of an engine whose whole report never arrived
                return
            if picture.incarnation:
                picture.replaced = True  # its predecessor's death notice may still come
            picture.retire()
            picture.incarnation = msg.incarnation
        elif not events.full and msg.seq != picture.seq + 1:
            picture.ask = True  # a report went missing: this delta is on top of one never taken
            return
        self.reported = True
        if events.full:
            picture.clear()
        picture.seq, picture.block_size = msg.seq, events.block_size
        picture.queried, picture.hits = max(0, events.queried), max(0, events.hits)
        for digest in events.removed:
            picture.remove(digest)
        for digest in events.stored:
            picture.store(digest, self.max_blocks)

    def _fits(self, msg: CacheReport) -> bool:
        size = msg.events.block_size
        if self.block_size in (0, size):
            self.block_size = size
            return True
        self.refused += 1
        logger.warning(
            "coordinator: dropped rank %d's cache report: blocks of %d tokens, the cluster's are %d",
            msg.rank,
            size,
            self.block_size,
        )
        return False

    def want(self, rank: int) -> None:
        """A client missed a change: the next one for ``rank`` is the whole picture (within a second)."""
        self._ranks[rank].whole = True

    def forget(self, rank: int) -> None:
        """The rank died: its engine's cache is gone (unless its replacement already reported)."""
        picture = self._ranks[rank]
        if picture.replaced:
            picture.replaced = False  # this death is the predecessor's; the picture is the new engine's
            return
        picture.retire()
        picture.clear()

    def asks(self, now: float) -> list[int]:
        """Ranks whose engines owe a whole report and have not been asked within a second."""
        out = []
        for rank, picture in enumerate(self._ranks):
            if picture.ask and now - picture.asked_at >= WHOLE_GAP_S:
                picture.ask, picture.asked_at = False, now
                out.append(rank)
        return out

    def pending(self, now: float) -> bool:
        return any(p.pending(now) for p in self._ranks)

    def changes(self, now: float) -> list[CacheChange]:
        """The changes to publish now (each rank's since the last call), numbered."""
        out = []
        for rank, picture in enumerate(self._ranks):
            if picture.pending(now):
                out.append(self._change(rank, picture, now))
        return out

    @staticmethod
    def _change(rank: int, picture: _RankPicture, now: float) -> CacheChange:
        whole = picture.whole
        base = -1 if whole else picture.version
        stored = list(picture.blocks) if whole else list(picture.stored)
        removed = [] if whole else sorted(picture.removed)
        picture.version += 1
        picture.stored, picture.removed, picture.whole = {}, set(), False
        if whole:
            picture.whole_at = now
        return CacheChange(rank, picture.version, base, picture.block_size, stored, removed)

    def hit_counts(self) -> list[tuple[int, int]]:
        """Per rank ``(queried, hits)`` prompt tokens; empty while no engine reported a cache."""
        return [(p.queried, p.hits) for p in self._ranks] if self.reported else []

    def versions(self) -> list[int]:
        """Per rank, the version of its latest change; empty while no engine reported a cache."""
        return [p.version for p in self._ranks] if self.reported else []

    def blocks(self, rank: int) -> int:
        """How many blocks the picture of ``rank`` holds (for tests and operators)."""
        return len(self._ranks[rank].blocks)


__all__ = ["DEFAULT_MAX_BLOCKS", "CachePictures"]
