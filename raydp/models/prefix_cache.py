"""A prefix cache for the reference engines: which prompt blocks a rank would hold, without the KV state.

It behaves as vLLM's does at the level routing sees: a prompt's full blocks
of ``block_size`` tokens are looked up from the first until one is missing
(those tokens are hits), the rest are stored, and past ``capacity`` blocks the
least recently used go. It reports through the engine core protocol's
``cache_events()`` (:class:`~raydp.wire.blocks.CacheEvents`), so the fast
tests drive prefix-cache-aware routing as vLLM engines do.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from raydp.engine.cache_report import CacheLedger
from raydp.errors import ConfigError
from raydp.wire.blocks import CacheEvents, iter_digests


class BlockCache:
    """An LRU set of block digests with hit counts and the events since the last report."""

    def __init__(self, capacity: int, block_size: int = 16) -> None:
        if capacity < 1:
            raise ConfigError(f"prefix_cache_blocks={capacity}: must be >= 1 (0 turns the cache off)")
        if block_size < 1:
            raise ConfigError(f"block_size={block_size}: must be >= 1 (tokens per cached block)")
        self.capacity, self.block_size = capacity, block_size
        self._blocks: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.ledger = CacheLedger(block_size)

    @property
    def hits(self) -> int:
        return self.ledger.hits

    def admit(self, prompt: Sequence[int]) -> int:
        """Look ``prompt`` up and store its blocks; return how many of its tokens were cached."""
        hit_blocks, missing = 0, False
        for digest in iter_digests(prompt, self.block_size):
            if not missing and digest in self._blocks:
                hit_blocks += 1
                self._blocks.move_to_end(digest)
                continue
            missing = True
            self._store(digest)
        self.ledger.count(len(prompt), hit_blocks * self.block_size)
        return hit_blocks * self.block_size

    def _store(self, digest: int) -> None:
        self._blocks[digest] = None
        self._blocks.move_to_end(digest)
        self.ledger.stored(digest)
        while len(self._blocks) > self.capacity:
            old, _ = self._blocks.popitem(last=False)
            self.ledger.removed(old)

    def events(self, full: bool) -> CacheEvents | None:
        """What changed since the last call (everything held, with ``full``); None when nothing did."""
        return self.ledger.events(full, self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)
