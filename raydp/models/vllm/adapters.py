"""``VllmAdapters``: the LoRA adapters one vLLM engine core holds, reported for adapter-aware routing.

vLLM keeps loaded adapters in an LRU cache of ``max_cpu_loras`` (by default
``max_loras``) in its worker, and says which by id (``list_loras``). Names
come from the requests and ``add_lora`` calls that name them; use order from
the requests, so the report lists the least recently used first, as routing
expects. The cache is read at most every ``REFRESH_S``: loads and evictions
are counted as differences between reads (one that came and went between two
reads is not seen). An adapter an API server unloaded is removed and
reported as ``unloaded`` until it is given again (:meth:`VllmAdapters.forget`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from raydp.wire.adapters import MAX_RESIDENT, AdapterState


class VllmAdapters:
    """What :meth:`VllmEngine.adapters` reports, from the engine core's ``list_loras``."""

    REFRESH_S = 0.1

    def __init__(self, core: Any, slots: int) -> None:
        self._core, self.slots = core, slots
        self._names: dict[int, str] = {}
        self._paths: dict[str, str] = {}  # every adapter it was given: name -> path
        self._unloaded: dict[str, None] = {}  # unloaded through an API server, oldest first (see forget)
        self._used: OrderedDict[int, None] = OrderedDict()  # ids, least recently used first
        self._resident: set[int] = set()
        self._read_at = float("-inf")
        self.loads = self.evictions = self.requests = self.hits = 0

    def named(self, lora_request: Any, given: bool = True) -> None:
        """Learn an adapter's name by its id: from an ``add_lora`` call (``given``: it is loaded again if it
        was unloaded), or from a request (one a server that has not heard of an unload yet may still send)."""
        if lora_request is None:
            return
        name = str(lora_request.lora_name)
        self._names[int(lora_request.lora_int_id)] = name
        if given:
            self._unloaded.pop(name, None)
        if name not in self._unloaded:
            self._paths[name] = str(lora_request.lora_path)

    def forget(self, name: str) -> list[int]:
        """An API server unloaded ``name``: the ids it had here (for the engine to remove), and it is
        reported as unloaded until it is loaded again, so that every API server forgets it too."""
        ids = [i for i, n in self._names.items() if n == name]
        for lora_id in ids:
            del self._names[lora_id]
            self._used.pop(lora_id, None)
        self._paths.pop(name, None)
        self._unloaded[name] = None
        while len(self._unloaded) > MAX_RESIDENT:  # bounded like the report: the oldest go first
            del self._unloaded[next(iter(self._unloaded))]
        return ids

    def arrived(self, lora_request: Any) -> None:
        """A request for this adapter arrived: a hit if vLLM held it at the last read."""
        self.named(lora_request, given=False)
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
        counts = (self.slots, self.loads, self.evictions, self.requests, self.hits)
        return AdapterState(names, *counts, known=dict(self._paths), unloaded=list(self._unloaded))


__all__ = ["VllmAdapters"]
