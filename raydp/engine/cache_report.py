"""Sends an engine core's prefix-cache events to the coordinator (engines with ``cache_events()``).

The engine core protocol's optional ``cache_events(full: bool) ->
CacheEvents | None`` returns what the engine's prefix cache stored and
evicted since the last call (block digests, :mod:`raydp.wire.blocks`) and its
cumulative hit counts, or None when nothing changed; with ``full`` it returns
everything the cache holds. The loop asks at most once per stats interval, so
a busy rank's stream of events costs one message per interval; it asks for
the whole picture when a coordinator (a restarted or moved one) must relearn
it, and for its first report, which replaces whatever a dead predecessor
on its rank reported. An engine without the method is never asked, and clients route its
prefixes by what was sent where.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from typing import Any

from raydp.wire.blocks import CacheEvents
from raydp.wire.control import CacheReport

logger = logging.getLogger("raydp.engine.core")


class CacheLedger:
    """An engine's side of ``cache_events()``: what changed since the last report, and the hit counts.

    The engine calls :meth:`stored` and :meth:`removed` as its cache changes
    and :meth:`count` per lookup; :meth:`events` turns them into the next
    :class:`CacheEvents`, given everything the cache holds for a full report.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._stored: dict[int, None] = {}
        self._removed: set[int] = set()
        self.queried = self.hits = 0
        self._counted = (0, 0)  # the counts last reported

    def stored(self, digest: int) -> None:
        self._removed.discard(digest)
        self._stored[digest] = None

    def removed(self, digest: int) -> None:
        self._stored.pop(digest, None)
        self._removed.add(digest)

    def count(self, prompt_tokens: int, cached_tokens: int) -> None:
        """One prefix-cache lookup: its prompt tokens, and those found cached."""
        self.queried += prompt_tokens
        self.hits += cached_tokens

    def events(self, full: bool, held: Collection[int]) -> CacheEvents | None:
        """The changes since the last call (all of ``held``, with ``full``); None when nothing changed."""
        counts = (self.queried, self.hits)
        if not full and not self._stored and not self._removed and counts == self._counted:
            return None
        stored = list(held) if full else list(self._stored)
        removed = [] if full else sorted(self._removed)
        self._stored, self._removed, self._counted = {}, set(), counts
        return CacheEvents(self.block_size, stored, removed, full, self.queried, self.hits)


class CacheReporter:
    """Asks the engine for its cache events and sends them as :class:`CacheReport`."""

    def __init__(self, engine: Any, rank: int, send: Callable[[CacheReport], None], gap_s: float) -> None:
        self._events: Callable[[bool], CacheEvents | None] | None = getattr(engine, "cache_events", None)
        self.rank, self._send, self._gap_s = rank, send, gap_s
        self._last = float("-inf")
        self._sent = False  # the first report is the whole picture: it replaces a dead predecessor's

    @property
    def enabled(self) -> bool:
        return callable(self._events)

    def maybe_send(self, now: float | None = None) -> None:
        """Send what changed, if the interval has passed since the last look."""
        now = time.monotonic() if now is None else now
        if self._events is None or now - self._last < self._gap_s:
            return
        self._last = now
        self._send_events(not self._sent)

    def send_full(self) -> None:
        """Send everything the cache holds (a coordinator relearning the ranks)."""
        if self._events is not None:
            self._last = time.monotonic()
            self._send_events(True)

    def _send_events(self, full: bool) -> None:
        assert self._events is not None
        events = self._events(full)
        if events is None:
            return
        self._sent = True
        if not isinstance(events, CacheEvents):
            raise TypeError(f"cache_events() returned {type(events).__name__}: must be CacheEvents or None")
        self._send(CacheReport(rank=self.rank, events=events))
