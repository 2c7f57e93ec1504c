"""``AdapterIndex``: a client's picture of which ranks hold which LoRA adapters.

Ranks report the adapters they hold (:class:`~raydp.wire.adapters.AdapterState`)
and each coordinator snapshot carries every rank's report whole. A report
lags what was just sent: an adapter this client sent to a rank counts as held
there for ``SENT_HOLD_S`` after the send, by when the rank's own report says
whether it loaded it (an engine reports at once when its step ends the last
request, and at least once a second while idle), so a burst for a new adapter
lands on one rank instead of loading it everywhere before the first report.
Engines that report no adapters are known by these sends alone.

It also keeps how often this client asked for each adapter lately (a count
that halves every ``DEMAND_HALF_LIFE_S``): loading an adapter where every slot
is taken evicts the rank's least recently used one, and the cheapest such
eviction is of the adapter asked for least (:meth:`AdapterIndex.eviction_cost`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from raydp.wire.adapters import AdapterState

SENT_HOLD_S = 2.0  # how long a send is remembered: long enough for the rank to load the adapter and say so
DEMAND_HALF_LIFE_S = 10.0  # how fast an adapter's demand is forgotten: a few rounds of a Zipf tail's arrivals


class AdapterIndex:
    """Per rank: the adapters its latest report lists, its slots, and this client's recent sends."""

    def __init__(self, engine_count: int = 0, clock: Callable[[], float] = time.monotonic) -> None:
        self._reported: list[AdapterState] = [AdapterState() for _ in range(engine_count)]
        self._paths: dict[str, str] = {}
        self._sent: list[dict[str, float]] = [{} for _ in range(engine_count)]  # adapter -> until when
        self._demand: dict[str, tuple[float, float]] = {}  # adapter -> (decayed count, as of when)
        self._clock = clock

    def truncate(self, engine_count: int) -> None:
        """Follow a resize: new ranks hold nothing yet, removed ranks are forgotten."""
        self._reported = (self._reported + [AdapterState() for _ in range(engine_count)])[:engine_count]
        self._sent = (self._sent + [{} for _ in range(engine_count)])[:engine_count]

    def on_snapshot(self, states: Sequence[AdapterState], paths: dict[str, str] | None = None) -> None:
        """Adopt the ranks' reports (an empty list: no rank reports adapters) and the adapters they were
        given (``paths``); forget old sends."""
        if not states and not paths and not any(self._sent) and not any(r.slots for r in self._reported):
            return  # a cluster without adapters: nothing to adopt, nothing to age (the hot path stays as it was)
        self._paths = dict(paths or {})
        n = len(self._reported)
        self._reported = (list(states[:n]) + [AdapterState() for _ in range(n)])[:n]
        now = self._clock()
        for sent in self._sent:
            for adapter in [a for a, until in sent.items() if until <= now]:
                del sent[adapter]

    def on_sent(self, rank: int, adapter: str) -> None:
        if adapter and 0 <= rank < len(self._sent):
            now = self._clock()
            self._sent[rank][adapter] = now + SENT_HOLD_S
            self._demand[adapter] = (self.demand(adapter) + 1.0, now)

    def demand(self, adapter: str) -> float:
        """How often this client asked for ``adapter`` lately (each send counts 1, halving every half-life)."""
        count, since = self._demand.get(adapter, (0.0, 0.0))
        return count * 0.5 ** ((self._clock() - since) / DEMAND_HALF_LIFE_S) if count else 0.0

    def eviction_cost(self, rank: int) -> float:
        """The demand for the adapter ``rank`` would evict to load another (its least recently used)."""
        resident = self._reported[rank].resident
        return self.demand(resident[0]) if resident else 0.0

    def forget(self, rank: int) -> None:
        """``rank`` died: its successor holds nothing until it says so."""
        if 0 <= rank < len(self._sent):
            self._reported[rank], self._sent[rank] = AdapterState(), {}

    def holds(self, rank: int, adapter: str) -> bool:
        return adapter in self._sent[rank] or adapter in self._reported[rank].resident

    def has_free_slot(self, rank: int) -> bool:
        """Whether ``rank`` can load one more adapter without evicting one (False where it reports no slots)."""
        held = set(self._reported[rank].resident) | set(self._sent[rank])
        return len(held) < self._reported[rank].slots

    def resident(self, rank: int) -> list[str]:
        return list(self._reported[rank].resident)

    def known(self) -> dict[str, str]:
        """Every adapter some rank was given by name, with its path."""
        return dict(self._paths)


__all__ = ["DEMAND_HALF_LIFE_S", "SENT_HOLD_S", "AdapterIndex"]
