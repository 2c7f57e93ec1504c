"""The request bookkeeping raydp's reference engines share.

The echo engine, the torch LM and the tensor-parallel LM schedule alike: a
request waits in arrival order until one of ``max_running`` slots frees up,
then produces one token per step until its token budget is spent. What
differs is how each computes a token, so that is all they write themselves:
:class:`ReferenceEngine` keeps the waiting and running tables, adds and aborts
requests, admits, counts each token against its budget and finishes the
request with ``"length"``, and reports ``load()`` and ``work()``. With a
prefix cache (:meth:`ReferenceEngine.keep_prefix_cache`) it also reports which
prompt blocks it would hold through ``cache_events()``, as vLLM engines do;
with adapter slots (:meth:`ReferenceEngine.keep_adapters`), which LoRA
adapters it would hold through ``adapters()``.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

from raydp.errors import ConfigError
from raydp.models.adapter_slots import AdapterSlots
from raydp.models.prefix_cache import BlockCache
from raydp.wire.adapters import AdapterState
from raydp.wire.blocks import CacheEvents
from raydp.wire.protocol import Output, Request
from raydp.wire.sampling import unsupported

# Sampling fields the reference engines honour: they decode greedily and always to the budget.
SUPPORTED_SAMPLING = ("ignore_eos",)


@dataclass(kw_only=True)
class Running:
    """An admitted request's progress: tokens produced out of its budget."""

    budget: int
    produced: int = 0
    adapter: str = ""


S = TypeVar("S", bound=Running)


class ReferenceEngine(ABC, Generic[S]):
    """Waiting and running requests for an engine that produces one token per running request per step.

    A subclass names itself in ``engine_name`` (sampling errors name it),
    builds an admitted request's state in :meth:`_start`, computes tokens in
    ``step()`` and hands each to :meth:`_advance`. It may record a token its
    next step needs in :meth:`_on_token`, and release what a request held
    (a KV cache) in :meth:`_release` when it finishes or is aborted.
    """

    engine_name: ClassVar[str]

    def __init__(self, max_running: int) -> None:
        self.max_running = max_running
        self._waiting: OrderedDict[str, Request] = OrderedDict()
        self._running: dict[str, S] = {}
        self.prefix_cache: BlockCache | None = None
        self.adapter_slots: AdapterSlots | None = None

    def keep_adapters(self, slots: int, load_s: float = 0.0) -> None:
        """Hold up to ``slots`` LoRA adapters (0: serve none), each load stalling a step ``load_s`` seconds."""
        self.adapter_slots = AdapterSlots(slots, load_s) if slots else None

    def adapters(self) -> AdapterState | None:
        """The adapters held, least recently used first, and the counts (None: this engine serves none)."""
        return self.adapter_slots.state() if self.adapter_slots is not None else None

    def keep_prefix_cache(self, blocks: int, block_size: int) -> None:
        """Keep a prefix cache of ``blocks`` blocks of ``block_size`` tokens (0 blocks: none).

        Which blocks it would hold, not KV state: the engine computes as
        before, and reports the blocks for prefix-cache-aware routing.
        """
        self.prefix_cache = BlockCache(blocks, block_size) if blocks else None

    def cache_events(self, full: bool) -> CacheEvents | None:
        """The prefix cache's stores and evictions since the last call (None without a cache)."""
        return self.prefix_cache.events(full) if self.prefix_cache is not None else None

    @abstractmethod
    def _start(self, request: Request) -> S:
        """The running state of ``request``, admitted to a free slot."""

    def _on_token(self, state: S, token: int) -> None:
        """Called with each token of a request that goes on running (nothing to record by default)."""

    def _release(self, state: S) -> None:
        """Called once a running request finishes or is aborted (nothing held by default)."""

    def add_request(self, request: Request) -> None:
        why = unsupported(self.engine_name, request.sampling, SUPPORTED_SAMPLING)
        if why:
            raise ConfigError(why)  # fails this request alone, naming the field
        if request.adapter:
            if self.adapter_slots is None:
                raise ConfigError(f"adapter={request.adapter!r}: {self.engine_name} was started without max_loras")
            self.adapter_slots.arrived(request.adapter)
        self._waiting[request.request_id] = request

    def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._waiting.pop(rid, None)
            state = self._running.pop(rid, None)
            if state is not None:
                self._end(state)

    def _admit(self) -> None:
        """Move waiting requests, oldest first, into the free running slots."""
        if self.adapter_slots is not None:
            return self._admit_with_adapters()
        while self._waiting and len(self._running) < self.max_running:
            rid, request = self._waiting.popitem(last=False)
            self._run(rid, request)
        return None

    def _admit_with_adapters(self) -> None:
        """:meth:`_admit`, passing over requests whose adapter has no slot free of running requests."""
        for rid, request in list(self._waiting.items()):
            if len(self._running) >= self.max_running:
                return
            if request.adapter and not self._take_adapter(request.adapter):
                continue
            del self._waiting[rid]
            self._run(rid, request)

    def _run(self, rid: str, request: Request) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.admit(request.prompt_token_ids)
        state = self._running[rid] = self._start(request)
        state.adapter = request.adapter

    def _take_adapter(self, adapter: str) -> bool:
        """Whether a request for ``adapter`` may start now; a load stalls this step, as vLLM's does."""
        assert self.adapter_slots is not None  # add_request refused adapters without slots
        loaded = self.adapter_slots.take(adapter)
        if loaded and self.adapter_slots.load_s:
            time.sleep(self.adapter_slots.load_s)
        return loaded is not None

    def _end(self, state: S) -> None:
        if state.adapter and self.adapter_slots is not None:
            self.adapter_slots.release(state.adapter)
        self._release(state)

    def _advance(self, rid: str, token: int) -> Output:
        """Count ``token`` against the request's budget: its output, finished with "length" once spent."""
        state = self._running[rid]
        state.produced += 1
        if state.produced >= state.budget:
            del self._running[rid]
            self._end(state)
            return Output(rid, [token], True, "length")
        self._on_token(state, token)
        return Output(rid, [token])

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def load(self) -> tuple[int, int]:
        return len(self._waiting), len(self._running)

    def work(self) -> int:
        """Tokens left to generate (``max_tokens`` bounds each): clients break load ties by it."""
        waiting = sum(request.max_tokens for request in self._waiting.values())
        return waiting + sum(state.budget - state.produced for state in self._running.values())

    def shutdown(self) -> None:
        self._waiting.clear()
        self._running.clear()


def fit_prompt(request: Request, vocab: int, max_len: int) -> tuple[list[int], int]:
    """A request's prompt for an LM of ``vocab`` tokens and ``max_len`` positions, and its token budget.

    Tokens wrap into the vocabulary, an empty prompt becomes ``[0]``, and the
    budget is ``max_tokens`` cut to the positions the prompt leaves (at least
    one token); a prompt longer than the model keeps its last ``max_len - 1``
    tokens.
    """
    prompt = [t % vocab for t in request.prompt_token_ids] or [0]
    budget = max(1, min(request.max_tokens, max_len - len(prompt)))
    return prompt[-(max_len - 1) :], budget


__all__ = ["SUPPORTED_SAMPLING", "ReferenceEngine", "Running", "fit_prompt"]
