"""Load-driven autoscaling: the policy (a pure state machine) and the loop that applies it.

:class:`AutoscalePolicy` turns load samples into a wanted size, Ray Serve's
way: the ongoing requests (waiting + running, over every routable rank),
averaged over the look-back window, divided by the target per rank, rounded
up and clipped to ``[min_dp_size, max_dp_size]``. A change is made only once
the same direction has been wanted for its whole delay (``upscale_delay_s``,
``downscale_delay_s``), so the size never flaps inside them. It holds no
clock and no I/O: the property tests drive it with made-up times.

:class:`Autoscaler` runs it on a thread wherever the cluster is supervised
(the launching process, or a detached cluster's supervisor): it reads the
coordinator's load every ``interval_s``, logs each decision with its reason,
hands it to the runtime (which shows it in ``raydp status`` and the
metrics), and calls the orchestrator's ``scale``, which drains on the way
down, waits for placement on the way up (pending placement groups are what
Ray's autoscaler adds nodes for), and moves lockstep clusters at a wave
boundary.

A P/D cluster runs one :class:`Autoscaler` per autoscaled pool, each over its
own pool's ranks and bounds (the pools' boundary is read afresh every
round, since either pool's change moves it). The prefill pool is sized by
its ongoing prefills, the decode pool by its ongoing streams. Both are
counts the coordinator has for free, and they carry the latency the issue
names: a prefill request lives on its rank until its first token, so by
Little's law the ongoing prefills are the arrival rate times the time to
first token spent there; a decode rank's ongoing streams are its batch,
and its inter-token latency grows with that batch. Latency targets would
need the API servers' measurements, which the coordinator does not have.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from raydp.config import AutoscalingConfig
from raydp.errors import RaydpError
from raydp.orchestration.controls import Controls, tick_while_alive
from raydp.wire.endpoints import ClusterEndpoints
from raydp.wire.records import AutoscaleDecision

Scale = Callable[[int, float, str | None], ClusterEndpoints]  # (size, drain_timeout_s, pool): the orchestrator's

logger = logging.getLogger("raydp.autoscaler")


@dataclass(frozen=True)
class Want:
    """What the policy wants now: ``size``, and why."""

    size: int
    load: float  # ongoing requests, averaged over the look-back window
    reason: str


class AutoscalePolicy:
    """The autoscaling decision as a pure state machine; see the module docstring."""

    def __init__(self, config: AutoscalingConfig) -> None:
        self.config = config
        self.samples: deque[tuple[float, float]] = deque()  # (time, ongoing requests)
        self.streak: tuple[int, float] | None = None  # (direction, since): the change wanted, and since when

    def observe(self, now: float, ongoing: float) -> None:
        """One load reading; readings older than the look-back window are forgotten."""
        self.samples.append((now, ongoing))
        while self.samples and self.samples[0][0] < now - self.config.look_back_s:
            self.samples.popleft()

    def raw(self, current: int) -> Want:
        """The size the averaged load asks for, clipped to the bounds, with no delay."""
        cfg = self.config
        load = sum(v for _, v in self.samples) / len(self.samples) if self.samples else 0.0
        size = min(cfg.max_dp_size, max(cfg.min_dp_size, math.ceil(load / cfg.target_ongoing_requests)))
        per_rank = load / max(current, 1)
        reason = (
            f"{load:.1f} ongoing requests over the last {cfg.look_back_s:g}s ({per_rank:.1f} per rank of {current}; "
            f"target {cfg.target_ongoing_requests:g} per rank)"
        )
        return Want(size, load, reason)

    def decide(self, now: float, current: int) -> Want | None:
        """A change to make now, or None. Out of bounds is corrected at once; otherwise a direction must
        have been wanted without a break for its delay."""
        cfg = self.config
        want = self.raw(current)
        if not cfg.min_dp_size <= current <= cfg.max_dp_size:
            self.streak = None
            return Want(min(cfg.max_dp_size, max(cfg.min_dp_size, current)), want.load, "outside the bounds")
        direction = (want.size > current) - (want.size < current)
        if direction == 0:
            self.streak = None
            return None
        if self.streak is None or self.streak[0] != direction:
            self.streak = (direction, now)
        delay = cfg.upscale_delay_s if direction > 0 else cfg.downscale_delay_s
        if now - self.streak[1] < delay:
            return None
        self.streak = None
        held = f"; wanted for {delay:g}s"
        return Want(want.size, want.load, want.reason + held)


class Autoscaler:
    """Applies an :class:`AutoscalePolicy` to a running cluster, on a thread of its own."""

    def __init__(
        self,
        controls: Controls,
        scale: Scale,
        config: AutoscalingConfig,
        pool: str | None = None,
        busy: Callable[[], bool] = lambda: False,
    ) -> None:
        self.c = controls
        self.scale = scale  # the orchestrator's: one scale change at a time, whoever asks
        # Whether a scale change runs: its sizes are half-way, so a reading now would be of neither.
        self.busy = busy
        self.config = config
        self.pool = pool  # a P/D cluster's pool ("prefill" or "decode"); None: the whole cluster
        self.policy = AutoscalePolicy(config)

    def start(self) -> None:
        """Step on a thread that holds this autoscaler weakly (whoever started it keeps it); a missed
        reading (the coordinator restarting) is tried again at the next interval."""
        tick_while_alive(self, Autoscaler.tick, self.config.interval_s, self.c.owned.stop, "raydp-autoscaler")

    def tick(self) -> None:
        self.step(time.monotonic())

    def step(self, now: float) -> None:
        """Read the load, decide, and make the change (blocking until it is done). Skipped while a change
        (another pool's, or a user's) runs."""
        if self.busy():
            return
        state = self.c.rt.coordinator_state()
        ranks = self.ranks(min(state.routable, len(state.counts)))
        ongoing = sum(sum(state.counts[r]) for r in ranks)
        current = self.size()
        self.policy.observe(now, ongoing)
        want = self.policy.decide(now, current)
        if want is None:
            self.record(current, current, "")
            return
        what = f"the {self.pool} pool" if self.pool else "cluster"
        logger.warning("autoscaler: %s %d -> %d ranks: %s", what, current, want.size, want.reason)
        self.record(current, want.size, want.reason)
        try:
            self.scale(want.size, self.config.drain_timeout_s, self.pool)
        except RaydpError as exc:
            logger.error(
                "autoscaler: scaling %s to %d ranks failed, serving on with %d: %s", what, want.size, current, exc
            )
        self.record(self.size(), want.size, want.reason)

    def ranks(self, routable: int) -> range:
        """The routable ranks of the pool this autoscaler sizes."""
        boundary = self.c.state.prefill_ranks
        if self.pool == "prefill":
            return range(min(boundary, routable))
        return range(boundary if self.pool == "decode" else 0, routable)

    def size(self) -> int:
        """The pool's ranks now (scale-ups under way included, as the policy's bounds count them)."""
        boundary, total = self.c.state.prefill_ranks, len(self.c.table)
        return boundary if self.pool == "prefill" else total - boundary if self.pool == "decode" else total

    def record(self, current: int, desired: int, reason: str) -> None:
        self.c.rt.record_autoscale(AutoscaleDecision(current, desired, reason, time.time(), self.pool or ""))
