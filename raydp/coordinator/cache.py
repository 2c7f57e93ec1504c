"""The coordinator's picture of what each rank's prefix cache holds, and the changes it publishes.

Engines report their cache's events (:class:`~raydp.wire.control.CacheReport`);
the coordinator keeps each rank's blocks and hands every client the same
picture through its snapshots: per rank, numbered changes
(:class:`~raydp.wire.control.CacheChange`), merged between two snapshots, and
the whole picture for a client that missed one (it sends
:class:`~raydp.wire.control.CacheWanted`). One publisher and one numbering is
what lets N API servers agree on which rank holds a prefix.

A rank's picture is bounded (``max_blocks``; past it the oldest blocks are
forgotten, as if evicted), emptied when the rank dies or restarts (a new
engine's cache is empty), and dropped with the rank on a scale-down.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from raydp.wire.blocks import CacheEvents
from raydp.wire.control import CacheChange

logger = logging.getLogger("raydp.coordinator")
DEFAULT_MAX_BLOCKS = 1 << 17  # per rank: ~1 MiB of digests in the picture, more than most engines' caches


@dataclass
class _RankPicture:
    blocks: dict[int, None] = field(default_factory=dict)  # insertion-ordered: the oldest go first
    version: int = 0  # of the last published change
    block_size: int = 0
    stored: dict[int, None] = field(default_factory=dict)  # since the last published change
    removed: set[int] = field(default_factory=set)
    whole: bool = False  # the next change is the whole picture
    queried: int = 0
    hits: int = 0

    def store(self, digest: int) -> None:
        self.blocks[digest] = None
        self.removed.discard(digest)
        self.stored[digest] = None

    def remove(self, digest: int) -> None:
        if digest in self.blocks:
            del self.blocks[digest]
            self.stored.pop(digest, None)
            self.removed.add(digest)  # clients may have it from an earlier change

    def pending(self) -> bool:
        return self.whole or bool(self.stored) or bool(self.removed)


class CachePictures:
    """Per-rank cache pictures for ``engine_count`` ranks; see the module docstring."""

    def __init__(self, engine_count: int, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._ranks: list[_RankPicture] = []
        self.reported = False  # some engine reports its cache: snapshots carry hit counts
        self.resize(engine_count)

    def resize(self, n: int) -> None:
        """``n`` ranks: a removed rank's picture goes with it, a new rank starts empty."""
        self._ranks = (self._ranks + [_RankPicture() for _ in range(n)])[:n]

    def report(self, rank: int, events: CacheEvents) -> None:
        picture = self._ranks[rank]
        self.reported = True
        picture.queried, picture.hits = max(0, events.queried), max(0, events.hits)
        if events.block_size != picture.block_size:
            picture.block_size = events.block_size
            picture.whole = True  # names at another block size replace the old ones
        if events.full:
            picture.blocks.clear()
            picture.whole = True
        for digest in events.removed:
            picture.remove(digest)
        for digest in events.stored:
            picture.store(digest)
        while len(picture.blocks) > self.max_blocks:
            picture.remove(next(iter(picture.blocks)))

    def want(self, rank: int) -> None:
        """A client missed a change: the next one for ``rank`` is the whole picture."""
        self._ranks[rank].whole = True

    def forget(self, rank: int) -> None:
        """The rank died or restarted: its engine's cache is gone."""
        picture = self._ranks[rank]
        picture.blocks.clear()
        picture.queried = picture.hits = 0
        picture.whole = True

    def pending(self) -> bool:
        return any(p.pending() for p in self._ranks)

    def changes(self) -> list[CacheChange]:
        """The changes to publish now (each rank's since the last call), numbered."""
        out = []
        for rank, picture in enumerate(self._ranks):
            if picture.pending():
                out.append(self._change(rank, picture))
        return out

    @staticmethod
    def _change(rank: int, picture: _RankPicture) -> CacheChange:
        base = -1 if picture.whole else picture.version
        stored = list(picture.blocks) if picture.whole else list(picture.stored)
        removed = [] if picture.whole else sorted(picture.removed)
        picture.version += 1
        picture.stored, picture.removed, picture.whole = {}, set(), False
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
