"""A client's copy of the coordinator's prefix-cache pictures: which ranks hold which blocks.

Built from the numbered :class:`~raydp.wire.control.CacheChange` records the
coordinator publishes (see :mod:`raydp.coordinator.cache`), so every client
process holds the same picture. Changes are applied only within one
coordinator's numbering (its ``epoch``). A change that does not follow the
version this client holds means one was missed: the rank's picture is kept as it is
(stale beats empty for routing), and :meth:`CacheIndex.behind`, against the
versions every snapshot carries, names it so the client asks for the whole.

The index maps a block digest to a bit mask of the ranks holding it, so the
longest cached prefix of a prompt is one dictionary lookup per block, stopping
at the first block no candidate holds; its memory is bounded by the pictures'.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

from raydp.wire.blocks import iter_digests
from raydp.wire.control import CacheChange

logger = logging.getLogger("raydp.client")
MAX_PROMPT_BLOCKS = 512  # blocks of a prompt looked up at most: the routing cost is bounded per request


class CacheIndex:
    """The ranks' cache pictures, by block digest; see the module docstring."""

    def __init__(self) -> None:
        self.block_size = 0  # 0 until an engine reports a cache
        self._holders: dict[int, int] = {}  # digest -> bit mask of ranks
        self._blocks: dict[int, set[int]] = {}  # rank -> its digests
        self._versions: dict[int, int] = {}
        self.epoch = 0  # the numbering followed: a coordinator's (a successor numbers afresh)

    def follow(self, epoch: int) -> None:
        """Follow coordinator ``epoch``'s numbering; a new one's changes never go on the old pictures."""
        if epoch and epoch != self.epoch:
            self._reset()
            self.epoch = epoch

    def apply(self, change: CacheChange) -> None:
        """Adopt one change; one not on top of this client's version is skipped (:meth:`behind` names its rank)."""
        rank = change.rank
        if change.block_size and change.block_size != self.block_size:  # 0: a rank with nothing reported
            if change.base != -1:
                return
            self._reset()  # the cluster's block size (one engine config for all ranks): it renames every block
            self.block_size = change.block_size
        if change.base == -1:
            self._drop_rank(rank)
        elif self._versions.get(rank) != change.base:
            return
        bit = 1 << rank
        blocks = self._blocks.setdefault(rank, set())
        for digest in change.removed:
            if digest in blocks:
                blocks.discard(digest)
                self._unhold(digest, bit)
        for digest in change.stored:
            if digest not in blocks:
                blocks.add(digest)
                self._holders[digest] = self._holders.get(digest, 0) | bit
        self._versions[rank] = change.version

    def behind(self, versions: Sequence[int]) -> list[int]:
        """The ranks whose picture here is not at the version the coordinator published last."""
        return [rank for rank, version in enumerate(versions) if self._versions.get(rank, 0) != version]

    def truncate(self, engine_count: int) -> None:
        """Forget the ranks at and above ``engine_count`` (removed by a scale-down)."""
        for rank in [r for r in self._blocks if r >= engine_count]:
            self._drop_rank(rank)
            self._versions.pop(rank, None)

    def longest(self, prompt: Sequence[int], ranks: Collection[int]) -> tuple[list[int], int]:
        """The ranks of ``ranks`` that hold the longest cached prefix of ``prompt``, and its length in blocks.

        ``([], 0)`` when none holds even the first block.
        """
        if not self.block_size or not self._holders:
            return [], 0
        candidates = sum(1 << r for r in ranks)
        depth = 0
        for count, digest in enumerate(iter_digests(prompt, self.block_size)):
            holding = candidates & self._holders.get(digest, 0)
            if not holding or count >= MAX_PROMPT_BLOCKS:
                break
            candidates, depth = holding, count + 1
        if depth == 0:
            return [], 0
        return [r for r in ranks if candidates >> r & 1], depth

    def blocks(self, rank: int) -> int:
        """How many blocks ``rank``'s picture holds here."""
        return len(self._blocks.get(rank, ()))

    def _reset(self) -> None:
        self._holders.clear()
        self._blocks.clear()
        self._versions.clear()

    def _drop_rank(self, rank: int) -> None:
        bit = 1 << rank
        for digest in self._blocks.pop(rank, set()):
            self._unhold(digest, bit)

    def _unhold(self, digest: int, bit: int) -> None:
        mask = self._holders.get(digest, 0) & ~bit
        if mask:
            self._holders[digest] = mask
        else:
            self._holders.pop(digest, None)
