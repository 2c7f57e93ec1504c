"""Sends the LoRA adapters an engine core holds to the coordinator (engines with ``adapters()``).

The engine core protocol's optional ``adapters() -> AdapterState | None``
says which adapters the engine holds, least recently used first, and its
load, eviction and hit counts (None: it serves no adapters). The loop asks
at most once per stats interval while it steps, and at once when it is about
to wait idle (its step ended the last request, a message came), and sends the
answer when it differs from the last one the coordinator took, so a rank
whose adapters do not change sends nothing; a restarted coordinator is sent
it again (``Resync``). Clients count an adapter as held where they sent it
until a report says otherwise, so a late report costs nothing but a stale
picture for a moment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from raydp.wire.adapters import AdapterState
from raydp.wire.control import AdapterReport


class AdapterReporter:
    """Asks the engine for its adapters at most every ``gap_s`` and sends what changed."""

    def __init__(self, engine: Any, rank: int, send: Callable[[AdapterReport], bool], gap_s: float) -> None:
        self._adapters: Callable[[], AdapterState | None] | None = getattr(engine, "adapters", None)
        self.rank, self._send, self._gap_s = rank, send, gap_s
        self._sent: AdapterState | None = None
        self._last = float("-inf")

    def maybe_send(self, now: float, force: bool = False) -> None:
        if self._adapters is None or (not force and now - self._last < self._gap_s):
            return
        self._last = now
        state = self._adapters()
        if state is None or state == self._sent:
            return
        if not isinstance(state, AdapterState):
            raise TypeError(f"adapters() returned {type(state).__name__}: must be AdapterState or None")
        self._sent = state if self._send(AdapterReport(rank=self.rank, state=state)) else None

    def send_again(self, now: float) -> None:
        """A restarted coordinator knows nothing: send the adapters whether or not they changed."""
        self._sent, self._last = None, float("-inf")
        self.maybe_send(now)
