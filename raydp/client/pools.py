"""Prefill/decode (P/D) pools as a client routes them.

A P/D cluster's first ``prefill_ranks`` ranks only prefill; the others
decode. A request with more than one token to make goes in two stages:

1. to a prefill rank, chosen by its prompt (prefix-cache affinity pays where
   prompts are computed), as ``prefill_only`` with a budget of one token. The
   rank computes the prompt, stores its KV through the engines' KV connector,
   and makes the first token;
2. once that token is out, to a decode rank chosen by load, with the prompt
   plus that token and the budget left, as a migrated stream goes on
   (:meth:`~raydp.client.requests.RequestState.continuation`). Its connector
   loads the prompt's KV instead of computing it.

The caller sees one stream. A request still on its prefill rank has streamed
nothing, so one whose rank dies is sent to another prefill rank; a decode
rank's death migrates the stream like any other. A one-token request is all
prefill: it runs on a prefill rank alone. A decode rank that makes no token
within ``kv_timeout_s`` of the hand-off (the KV never came) fails the request
with :class:`~raydp.errors.KVTransferError`, and the request is aborted there.
A request that could not resume from
its first token on another rank (vLLM's structured outputs, seeded sampling,
penalties: :func:`raydp.serve.vllm_core.migration_blocker`) is never split: it
runs whole on a decode rank.
"""

from __future__ import annotations

from collections.abc import Callable

from raydp.client.requests import RequestState

# How long a decode rank may take to make a P/D request's first token after the hand-off, before the
# request fails with KVTransferError: the KV that should have come from the prefill rank never did.
# Generous: it includes the decode rank's queue, and a KV transfer of a long prompt.
DEFAULT_KV_TIMEOUT_S = 120.0


def wants_prefill_first(prefill_ranks: int, state: RequestState, pinned: int | None, whole: bool) -> bool:
    """Whether a new request goes in two stages (a pinned one runs where it is pinned; a ``whole`` one,
    which could not resume from its first token, on one decode rank)."""
    return bool(prefill_ranks) and pinned is None and not whole and state.original.max_tokens > 1


def pool_of(state: RequestState, prefill_ranks: int, size: int) -> tuple[range | None, bool]:
    """The ranks ``state``'s next send may go to (None: any), and whether its prompt picks among them."""
    if not prefill_ranks:
        return None, True
    if state.handoff or state.original.max_tokens <= 1:
        return range(prefill_ranks), True
    return range(prefill_ranks, size), False


class KvWaits:
    """P/D requests handed to a decode rank that has not made their first token yet, with their deadlines.

    Each is keyed by request id and remembered with the ``seq`` of its decode
    send: a request aborted, failed over or migrated since is sent again under
    another ``seq``, and its old deadline no longer applies.
    """

    def __init__(self, timeout_s: float = DEFAULT_KV_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._due: dict[str, tuple[float, int]] = {}  # request id -> (deadline, seq of the decode send)

    def __bool__(self) -> bool:
        return bool(self._due)

    def start(self, request_id: str, seq: int, now: float) -> None:
        self._due[request_id] = (now + self.timeout_s, seq)

    def arrived(self, request_id: str) -> None:
        """The decode rank's first token: its KV came."""
        self._due.pop(request_id, None)

    def expired(self, now: float, current_seq: Callable[[str], int | None]) -> list[str]:
        """The requests past their deadline (forgotten here); those sent again since are forgotten too."""
        late = []
        for rid, (due, seq) in list(self._due.items()):
            if current_seq(rid) != seq:
                del self._due[rid]
            elif due <= now:
                del self._due[rid]
                late.append(rid)
        return late
