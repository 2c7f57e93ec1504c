"""Utility calls waiting for their engine's answer (``Client.call_utility``).

Only the client's IO thread touches a :class:`PendingCalls`; callers wait on
the :class:`~concurrent.futures.Future` each entry completes.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from raydp.errors import RaydpError
from raydp.wire.protocol import UtilityResult


class PendingCalls:
    """Call id -> (rank, method, future), until the answer, a death or the caller gives up."""

    def __init__(self) -> None:
        self._calls: dict[int, tuple[int, str, Future[Any]]] = {}

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, call_id: int, rank: int, method: str, future: Future[Any]) -> None:
        self._calls[call_id] = (rank, method, future)

    def resolve(self, answer: UtilityResult) -> None:
        """Complete the call ``answer`` is for; an answer nobody waits for any more is ignored."""
        entry = self._calls.pop(answer.call_id, None)
        if entry is None:
            return
        rank, method, future = entry
        if answer.error is not None:
            future.set_exception(RaydpError(f"utility {method!r} on rank {rank} failed: {answer.error}"))
        else:
            future.set_result(answer.result)

    def forget(self, call_id: int) -> None:
        entry = self._calls.pop(call_id, None)
        if entry is not None:
            entry[2].cancel()

    def fail(self, error: BaseException, rank: int | None = None) -> None:
        """Fail the calls on ``rank`` (every call if None) with ``error``."""
        for call_id, (call_rank, _, future) in list(self._calls.items()):
            if rank is None or call_rank == rank:
                del self._calls[call_id]
                if not future.done():
                    future.set_exception(error)
