"""Sends an engine core's prefix-cache events to the coordinator (engines with ``cache_events()``).

The engine core protocol's optional ``cache_events(full: bool) ->
CacheEvents | None`` returns what the engine's prefix cache stored and
evicted since the last call (block digests, :mod:`raydp.wire.blocks`) and its
cumulative hit counts, or None when nothing changed; with ``full`` it returns
everything the cache holds. The loop asks at most once per stats interval, so
a busy rank's stream of events costs one message per interval; it asks for
the whole picture for its first report (which replaces whatever a dead
predecessor on its rank reported), when a coordinator (a restarted or moved
one) must relearn it, and when a report was lost (the coordinator sees a gap
in the numbers and sends ``SendCache``, or the send was refused here). An
engine without the method is never asked, and clients route its prefixes by
what was sent where.
"""

from __future__ import annotations

import logging
import secrets
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
    r"""Asks the engine for its cache events and sends them as numbered :class:`CacheReport`\ s.

    A whole report goes first, after a send the coordinator's queue refused,
    and when the coordinator asks (``Resync``, ``SendCache``); at most one a
    second after the first, since a restarted coordinator repeats its asks.
    """

    FULL_GAP_S = 1.0

    def __init__(self, engine: Any, rank: int, send: Callable[[CacheReport], bool], gap_s: float) -> None:
        self._events: Callable[[bool], CacheEvents | None] | None = getattr(engine, "cache_events", None)
        self.rank, self._send, self._gap_s = rank, send, gap_s
        self.incarnation = secrets.randbits(62) + 1  # this engine process, told from its predecessors
        self._seq = 0
        self._last = float("-inf")
        self._last_full = float("-inf")
        self._owe_full = True  # the first report is the whole picture: it replaces a dead predecessor's

    def maybe_send(self, now: float | None = None) -> None:
        """Send what changed (or the whole cache, if one is owed), if the interval has passed."""
        now = time.monotonic() if now is None else now
        if self._events is None or now - self._last < self._gap_s:
            return
        self._last = now
        full = self._owe_full and now - self._last_full >= self.FULL_GAP_S
        if self._owe_full and not full:
            return  # a whole report is owed: no delta before it, or the coordinator would see a gap
        self._send_events(full, now)

    def send_full(self, now: float | None = None) -> None:
        """Owe the coordinator the whole cache; sent at once unless one went out within a second."""
        self._owe_full = True
        self._last = float("-inf")
        self.maybe_send(now)

    def _send_events(self, full: bool, now: float) -> None:
        assert self._events is not None
        events = self._events(full)
        if events is None:
            return
        if not isinstance(events, CacheEvents):
            raise TypeError(f"cache_events() returned {type(events).__name__}: must be CacheEvents or None")
        self._seq += 1
        if full:
            self._owe_full, self._last_full = False, now
        if not self._send(CacheReport(rank=self.rank, incarnation=self.incarnation, seq=self._seq, events=events)):
            self._owe_full = True  # the coordinator missed this one: only the whole cache makes up for it
