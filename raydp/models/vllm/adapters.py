"""``VllmAdapters``: the LoRA adapters one vLLM engine core holds, reported for adapter-aware routing.

vLLM keeps loaded adapters in an LRU cache of ``max_cpu_loras`` (by default
``max_loras``) in its worker, and says which by id (``list_loras``). Names
come from the requests and ``add_lora`` calls that name them; use order from
the requests, so the report lists the least recently used first, as routing
expects. The cache is read at most every ``REFRESH_S``: loads and evictions
are counted as differences between reads (one that came and went between two
reads is not seen).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from raydp.wire.adapters import AdapterState


class VllmAdapters:
    """What :meth:`VllmEngine.adapters` reports, from the engine core's ``list_loras``."""

    REFRESH_S = 0.1

    def __init__(self, core: Any, slots: int) -> None:
        self._core, self.slots = core, slots
        self._names: dict[int, str] = {}
        self._paths: dict[str, str] = {}  # every adapter it was given: name -> path
        self._used: OrderedDict[int, None] = OrderedDict()  # ids, least recently used first
        self._resident: set[int] = set()
        self._read_at = float("-inf")
        self.loads = self.evictions = self.requests = self.hits = 0

    def named(self, lora_request: Any) -> None:
        """Learn an adapter's name by its id (an ``add_lora`` call, a request)."""
        if lora_request is not None:
            name = str(lora_request.lora_name)
            self._names[int(lora_request.lora_int_id)] = name
            self._paths[name] = str(lora_request.lora_path)

    def arrived(self, lora_request: Any) -> None:
        """A request for this adapter arrived: a hit if vLLM held it at the last read."""
        self.named(lora_request)
        lora_id = int(lora_request.lora_int_id)
        self.requests += 1
        self.hits += lora_id in self._resident
        self._used[lora_id] = None
        self._used.move_to_end(lora_id)

    def state(self, now: float) -> AdapterState:
        if now - self._read_at >= self.REFRESH_S:
            self._read_at = now
            held = {int(i) for i in self._core.list_loras()}
            self.loads += len(held - self._resident)
            self.evictions += len(self._resident - held)
            self._resident = held
        order = [i for i in self._used if i in self._resident]
        order = sorted(self._resident - set(order)) + order  # never used by a request: least recent
        names = [self._names[i] for i in order if i in self._names]
        return AdapterState(names, self.slots, self.loads, self.evictions, self.requests, self.hits, dict(self._paths))


__all__ = ["VllmAdapters"]
