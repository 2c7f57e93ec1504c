"""A dense rank's restart budget: so many restarts in a sliding window, each later one after a longer wait.

The shape is Kubernetes' and Ray Serve's: a rank that keeps failing is
restarted with exponential backoff, and once it has used ``max_restarts``
within ``window_s`` it stays down (the cluster serves on, degraded). A
restart older than the window no longer counts, so a rank that ran well for
a window gets its whole budget back, as a pod's backoff resets after ten
minutes of running. A restart that fails (its successor never started, or
wedged past ``startup_timeout_s``) is one more death: it spends the budget as
a death does, so a transient startup wedge is retried after the backoff and
a rank that can never start stays down once the budget is spent.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable


class RestartBudget:
    """Restarts per rank in a sliding window, and the backoff before each; callers hold their own lock."""

    def __init__(
        self,
        max_restarts: int,
        ranks: Iterable[int] = (),
        *,
        window_s: float = float("inf"),
        backoff_s: float = 0.0,
        backoff_max_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_restarts, self.window_s = max_restarts, window_s
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self._clock = clock
        self._taken: dict[int, deque[float]] = {rank: deque() for rank in ranks}

    def grant(self, ranks: Iterable[int]) -> None:
        """New ranks (at startup or a scale-up) get the full budget."""
        for rank in ranks:
            self._taken[rank] = deque()

    def take(self, rank: int) -> float | None:
        """Spend one restart of ``rank``: the seconds to wait before it, or None when none is left."""
        taken = self._taken.get(rank)
        if taken is None:
            return None
        now = self._clock()
        while taken and now - taken[0] >= self.window_s:
            taken.popleft()
        if len(taken) >= self.max_restarts:
            return None
        # The first restart in a window is at once: most deaths are one-off (a killed process, a lost node).
        delay = 0.0 if not taken else min(self.backoff_s * 2 ** (len(taken) - 1), self.backoff_max_s)
        taken.append(now)
        return delay

    def forget(self, rank: int) -> None:
        self._taken.pop(rank, None)
