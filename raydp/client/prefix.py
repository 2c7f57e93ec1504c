"""Prefix affinity for the ``prefix`` routing policy: which ranks a prompt's prefix prefers, in order.

A prompt's *key* is a digest of its first ``prefix_tokens`` tokens (all of
them, if it is shorter): prompts that share that much (a system prompt, the
earlier turns of a chat) share a key. Each key ranks the live ranks by
rendezvous (highest-random-weight) hashing, so that

* every client process computes the same order from the prompt alone: API
  servers, drivers and notebooks agree without exchanging a table, and a
  prefix is never spread over N ranks by N servers;
* it needs no memory: nothing grows with the number of prefixes;
* when a rank dies, is removed or is added, only the keys whose first choice
  it was (or becomes) move; every other prefix stays where its cache is.

Digests are BLAKE2b, not ``hash()``: Python salts ``hash`` per process.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence

DEFAULT_PREFIX_TOKENS = 64


def prefix_key(prompt: Sequence[int], prefix_tokens: int = DEFAULT_PREFIX_TOKENS) -> bytes:
    """The digest of the prompt's first ``prefix_tokens`` token ids."""
    head = array("q", prompt[:prefix_tokens])
    return hashlib.blake2b(head.tobytes(), digest_size=16).digest()


def preference(key: bytes, ranks: Iterable[int]) -> list[int]:
    """``ranks`` in the key's order of preference (rendezvous hashing: the highest weight first)."""

    def weight(rank: int) -> bytes:
        return hashlib.blake2b(key + rank.to_bytes(4, "little"), digest_size=8).digest()

    return sorted(ranks, key=weight, reverse=True)
