"""vLLM's KV-cache events as raydp block names, for ``cache_events()`` (prefix-cache-aware routing).

vLLM's scheduler publishes what its prefix cache stores and evicts
(``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) once
``kv_events_config.enable_kv_cache_events`` is set. Its block hashes are salted
per process, so no client could compute them; :class:`VllmCacheEvents` renames
each block by raydp's chained digest of its token ids
(:func:`raydp.wire.blocks.block_digest`), which any client computes from a
prompt. Blocks whose hash has extra keys (a LoRA, multimodal inputs, a
``cache_salt``) are left out: a plain prompt of the same tokens cannot use
them. The hit counts come from each request's first output (vLLM's prefill
stats: prompt tokens, and those found in the local prefix cache).
"""

from __future__ import annotations

import logging
from typing import Any

from raydp.engine.cache_report import CacheLedger
from raydp.wire.blocks import ROOT, CacheEvents, block_digest

logger = logging.getLogger("raydp.models.vllm")


class VllmCacheEvents:
    """Follows one engine's KV-cache events; :meth:`events` reports them in raydp's names."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # vLLM block hash -> (raydp digest, cached copies): vLLM may cache two blocks under one hash,
        # and the name goes only with the last of them.
        self._names: dict[Any, tuple[int, int]] = {}
        self.ledger = CacheLedger(block_size)

    def publish(self, batch: Any) -> None:
        """Take one ``KVEventBatch`` (the scheduler calls this as its event publisher)."""
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        for event in batch.events:
            if isinstance(event, BlockStored):
                self._on_stored(event)
            elif isinstance(event, BlockRemoved):
                if event.group_idx in (None, 0):
                    self._on_removed(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                for digest, _ in self._names.values():
                    self.ledger.removed(digest)
                self._names.clear()

    def _on_stored(self, event: Any) -> None:
        if event.lora_name or event.lora_id or (event.extra_keys and any(event.extra_keys)):
            return
        if event.group_idx not in (None, 0) or event.block_size != self.block_size:
            return  # another KV-cache group (a hybrid model's): the first names the prefix
        known = None if event.parent_block_hash is None else self._names.get(event.parent_block_hash)
        if event.parent_block_hash is not None and known is None:
            return  # its parent was evicted or left out: this block is of no use to a prompt
        parent = ROOT if known is None else known[0]
        size = self.block_size
        for i, vllm_hash in enumerate(event.block_hashes):
            parent = block_digest(parent, event.token_ids[i * size : (i + 1) * size])
            _, copies = self._names.get(vllm_hash, (parent, 0))
            self._names[vllm_hash] = (parent, copies + 1)
            if not copies:
                self.ledger.stored(parent)

    def _on_removed(self, hashes: list[Any]) -> None:
        for vllm_hash in hashes:
            entry = self._names.get(vllm_hash)
            if entry is None:
                continue
            digest, copies = entry
            if copies > 1:
                self._names[vllm_hash] = (digest, copies - 1)
            else:
                del self._names[vllm_hash]
                self.ledger.removed(digest)

    def count(self, prompt_tokens: int, cached_tokens: int) -> None:
        """One request's prefix-cache lookup: its prompt tokens, and those found cached."""
        self.ledger.count(prompt_tokens, cached_tokens)

    def events(self, full: bool) -> CacheEvents | None:
        return self.ledger.events(full, [digest for digest, _ in self._names.values()] if full else ())


class TeePublisher:
    """Stands in for the scheduler's event publisher: raydp takes every batch, then the user's publisher."""

    def __init__(self, ours: VllmCacheEvents, theirs: Any) -> None:
        self.ours, self.theirs = ours, theirs

    def publish(self, batch: Any) -> None:
        self.ours.publish(batch)
        self.theirs.publish(batch)

    def shutdown(self) -> None:
        self.theirs.shutdown()


def events_config(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``engine_kwargs`` with vLLM's KV-cache events on (unless the user configured them: then theirs)."""
    if engine_kwargs.get("enable_prefix_caching") is False or "kv_events_config" in engine_kwargs:
        return engine_kwargs
    from vllm.config import KVEventsConfig

    # "null": the scheduler collects the events and its publisher drops them; raydp takes them from it.
    return {**engine_kwargs, "kv_events_config": KVEventsConfig(enable_kv_cache_events=True, publisher="null")}
