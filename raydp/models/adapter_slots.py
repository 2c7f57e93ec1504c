"""``AdapterSlots``: the LoRA adapters a reference engine would hold, as vLLM holds them.

A rank holds at most ``slots`` adapters (vLLM's ``max_loras``). A request
for a held adapter starts at once; one for another adapter loads it first,
evicting the least recently used adapter that no running request uses, and
the load stalls the whole step, as vLLM's synchronous load does. While every
slot is in use by running requests, a request for another adapter waits.
No weights are involved: what the slots track is what routing needs to be
tested and measured against, the loads (swaps) each policy causes.
"""

from __future__ import annotations

import collections
from collections import OrderedDict

from raydp.errors import ConfigError
from raydp.wire.adapters import AdapterState


class AdapterSlots:
    """``slots`` adapters at once, least recently used first; ``load_s`` seconds of stall per load."""

    def __init__(self, slots: int, load_s: float = 0.0) -> None:
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ConfigError(f"max_loras={slots!r}: must be an int >= 1 (adapters a rank holds at once)")
        if not isinstance(load_s, (int, float)) or not 0 <= load_s <= 60:
            raise ConfigError(f"adapter_load_s={load_s!r}: must be a number of seconds in [0, 60]")
        self.slots, self.load_s = slots, float(load_s)
        self._resident: OrderedDict[str, None] = OrderedDict()
        self._in_use: collections.Counter[str] = collections.Counter()
        self.loads = self.evictions = self.requests = self.hits = 0

    def arrived(self, adapter: str) -> None:
        """A request for ``adapter`` arrived: a hit if it is held already."""
        self.requests += 1
        self.hits += adapter in self._resident

    def take(self, adapter: str) -> bool | None:
        """A request for ``adapter`` starts: False if held, True if it had to be loaded, None if no slot is free
        of running requests (it must wait)."""
        if adapter in self._resident:
            self._resident.move_to_end(adapter)
            self._in_use[adapter] += 1
            return False
        if len(self._resident) >= self.slots:
            victim = next((a for a in self._resident if not self._in_use[a]), None)
            if victim is None:
                return None
            del self._resident[victim]
            self.evictions += 1
        self._resident[adapter] = None
        self._in_use[adapter] += 1
        self.loads += 1
        return True

    def release(self, adapter: str) -> None:
        """A request for ``adapter`` finished or was aborted (its adapter stays held until evicted)."""
        self._in_use[adapter] -= 1
        if self._in_use[adapter] <= 0:
            del self._in_use[adapter]

    def state(self) -> AdapterState:
        return AdapterState(list(self._resident), self.slots, self.loads, self.evictions, self.requests, self.hits)


__all__ = ["AdapterSlots"]
