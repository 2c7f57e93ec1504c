"""Prefix-cache blocks as every process names them: chained digests of token blocks.

An engine's prefix cache holds a prompt's KV state in blocks of
``block_size`` tokens, and a block is only usable after every block before it,
so a block is named by its tokens *and* its parent: block ``i``'s digest is
BLAKE2b over block ``i - 1``'s digest and block ``i``'s token ids. Engines
report what they hold in these names (:class:`CacheEvents`, whatever their
own hashing is: vLLM's is salted per process), and clients compute the same
names from a prompt, so any client process can tell which rank holds the
longest cached prefix of a prompt without asking.

Digests are 64-bit unsigned integers: msgpack carries them as they are, and
at 64 bits two blocks of one cluster share a name once in ~10^19 pairs.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence
from typing import Annotated, Final

import msgspec

from raydp.wire.codec import WireMessage

ROOT: Final = 0  # the parent digest of a prompt's first block
BlockDigest = int
MAX_REPORTED_BLOCKS: Final = 1 << 20  # digests in one report: a peer cannot make a decoder allocate without end
Digests = Annotated[list[int], msgspec.Meta(max_length=MAX_REPORTED_BLOCKS)]


def block_digest(parent: BlockDigest, tokens: Sequence[int]) -> BlockDigest:
    """The name of a block of ``tokens`` after the block named ``parent``."""
    data = parent.to_bytes(8, "little") + array("q", tokens).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def iter_digests(tokens: Sequence[int], block_size: int, parent: BlockDigest = ROOT) -> Iterator[BlockDigest]:
    """The digests of ``tokens``' full blocks, first to last (a partial last block has none).

    Lazy, so that a caller looking for the longest cached prefix stops
    hashing at the first block nobody holds.
    """
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_digest(parent, tokens[start : start + block_size])
        yield parent


def block_digests(tokens: Sequence[int], block_size: int, parent: BlockDigest = ROOT) -> list[BlockDigest]:
    """All of :func:`iter_digests`."""
    return list(iter_digests(tokens, block_size, parent))


class CacheEvents(WireMessage):
    """What an engine's prefix cache did since its last report (the engine core's ``cache_events()``).

    ``stored`` and ``removed`` are block digests (:func:`block_digest`);
    with ``full`` set, ``stored`` is everything the cache holds and replaces
    what was reported before (an engine answers ``cache_events(full=True)``
    so, for a restarted coordinator). ``queried`` and ``hits`` count prompt
    tokens looked up in the cache and found there, since the engine started:
    their ratio is the rank's prefix-cache hit rate.
    """

    block_size: Annotated[int, msgspec.Meta(ge=1)]
    stored: Digests = []
    removed: Digests = []
    full: bool = False
    queried: int = 0
    hits: int = 0


def hit_rate(queried: int, hits: int) -> float | None:
    """``hits / queried``, or None before any lookup."""
    return hits / queried if queried > 0 else None


__all__ = ["ROOT", "BlockDigest", "CacheEvents", "block_digest", "block_digests", "hit_rate", "iter_digests"]
