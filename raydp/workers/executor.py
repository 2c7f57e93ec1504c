"""The driver side of a rank's workers: steps and calls over the channel, death bookkeeping.

:class:`ChannelExecutor` implements :class:`~raydp.engine.executor.Executor`
over one :class:`~raydp.workers.channel.Link` per worker. The backends
subclass it: they start the workers, hand over the links, and report a
worker's death with :meth:`mark_dead`, which fails the call waiting on the
channel within one poll slice and tells the rank (``on_death``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from raydp.engine.executor import WorkerContext
from raydp.errors import DeathCause, ProtocolError, RaydpError, WorkerDeadError, WorkerError
from raydp.workers.channel import (
    POLL_SLICE_S,
    RPC,
    STEP,
    STOP,
    Call,
    Link,
    LinkClosedError,
    call_encoder,
    reply_decoder,
)

logger = logging.getLogger("raydp.executor")
DeathHandler = Callable[[WorkerDeadError], None]
MONITOR_GRACE_S = 0.2


class ChannelExecutor:
    """Steps and calls over the links of ``contexts`` (one per TP rank); see the module docstring."""

    def __init__(self, contexts: Sequence[WorkerContext], on_death: DeathHandler | None = None) -> None:
        self.contexts = list(contexts)
        self.dp_rank = contexts[0].dp_rank
        self.links: list[Link] = []
        self._on_death = on_death
        self._dead: WorkerDeadError | None = None
        self._broken: str | None = None
        self._closing = threading.Event()
        self._seq = 0

    @property
    def world_size(self) -> int:
        return len(self.contexts)

    # ---- the Executor interface ------------------------------------------------------

    def execute_step(self, step_input: Any) -> Any:
        # Every worker steps; only the driver answers (the others write only to report a failure).
        return self._call(STEP, "execute_step", step_input, None, None, range(self.world_size), range(1))[0]

    def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
        driver_only: bool = False,
    ) -> list[Any]:
        targets = range(1) if driver_only else range(self.world_size)
        return self._call(RPC, method, list(args), dict(kwargs or {}), timeout_s, targets, targets)

    def check_health(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._broken is not None:  # a call timed out half-way: the links are out of step for good
            raise ProtocolError(self._broken)

    def close(self) -> None:
        """Ask every worker to stop, then let the backend end them (``_stop_workers``).

        After a worker's death the survivors' group is broken: they are ended at once.
        """
        if self._closing.is_set():
            return
        self._closing.set()
        graceful = self._dead is None and self._broken is None
        stop = call_encoder.encode(Call(STOP, 0))
        for link in self.links if graceful else ():
            try:
                link.send(stop)
            except (LinkClosedError, OSError):
                pass
        try:
            self._stop_workers(graceful)
        finally:
            for link in self.links:
                link.close()

    # ---- for the backends --------------------------------------------------------------

    def mark_dead(self, tp_rank: int, cause: DeathCause, detail: str) -> None:
        """A worker died: fail what waits on it, and tell the rank once."""
        if self._closing.is_set() or self._dead is not None:
            return
        ctx = self.contexts[tp_rank]
        self._dead = WorkerDeadError(ctx.dp_rank, tp_rank, ctx.node_id, cause, detail)
        logger.error("%s", self._dead)
        if self._on_death is not None:
            self._on_death(self._dead)

    def _stop_workers(self, graceful: bool) -> None:
        """End the worker actors or processes (the backend's part of close); ``graceful``: they were asked."""

    # ---- the channel ----------------------------------------------------------------------

    def _call(
        self,
        kind: int,
        method: str,
        args: Any,
        kwargs: Any,
        timeout_s: float | None,
        targets: range,
        answered_by: range,
    ) -> list[Any]:
        self.check_health()
        if self._closing.is_set():
            raise RaydpError(f"the workers of rank {self.dp_rank} are closed")
        self._check_followers()
        self._seq += 1
        frame = call_encoder.encode(Call(kind, self._seq, method, args, kwargs))
        for tp in targets:
            self._send(tp, frame)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        alive = self._alive_stepping if kind == STEP else self.check_health
        replies = [self._recv(tp, deadline, alive) for tp in answered_by]
        return self._results(method, replies)

    def _alive_stepping(self) -> None:
        """While the driver worker is slow to answer, a follower may be reporting why (e.g. it raised)."""
        self.check_health()
        self._check_followers()

    def _check_followers(self) -> None:
        """Raise the failure a follower (TP rank > 0) reported on a step; they write for nothing else."""
        for tp in range(1, len(self.links)):
            if self.links[tp].ready():
                reply = self._recv(tp, time.monotonic() + POLL_SLICE_S * 20, self.check_health, expect_seq=False)
                ctx = self.contexts[tp]
                why = str(reply.value) if not reply.ok else "an unexpected reply to a step"
                self._peer_death_first()
                self._broken = f"worker tp{tp} of rank {self.dp_rank} failed a step"
                raise WorkerError(ctx.dp_rank, tp, ctx.node_id, "execute_step", why)

    def _send(self, tp: int, frame: bytes) -> None:
        try:
            self.links[tp].send(frame)
        except LinkClosedError as exc:
            self._lost(tp, str(exc))

    def _recv(self, tp: int, deadline: float | None, alive: Callable[[], None], expect_seq: bool = True) -> Any:
        try:
            frame = self.links[tp].recv(deadline, alive)
        except LinkClosedError as exc:
            self._lost(tp, str(exc))
        except TimeoutError:
            self._broken = f"worker tp{tp} of rank {self.dp_rank} did not answer in time"
            raise
        except ProtocolError as exc:  # an oversized frame
            self._broken = f"worker tp{tp} of rank {self.dp_rank}: {exc}"
            raise
        try:
            reply = reply_decoder.decode(frame)
        except msgspec.MsgspecError as exc:  # the channel cannot be trusted any more
            self._broken = f"worker tp{tp} of rank {self.dp_rank} sent a malformed reply: {exc}"
            raise ProtocolError(self._broken) from None
        if expect_seq and reply.seq != self._seq:
            self._broken = f"worker tp{tp} answered call {reply.seq}, expected {self._seq}"
            raise ProtocolError(self._broken)
        return reply

    def _lost(self, tp: int, why: str) -> Any:
        """A closed link is a dead worker, even before the backend's monitor says so.

        The monitor knows the cause (killed, node died...), so it gets a moment to report first.
        """
        deadline = time.monotonic() + MONITOR_GRACE_S
        while self._dead is None and time.monotonic() < deadline:
            time.sleep(0.005)
        self.mark_dead(tp, DeathCause.PROCESS_DIED, f"its channel closed ({why})")
        self.check_health()
        raise WorkerDeadError(self.dp_rank, tp, self.contexts[tp].node_id, DeathCause.UNKNOWN, why)

    def _results(self, method: str, replies: list[Any]) -> list[Any]:
        for tp, reply in enumerate(replies):
            if not reply.ok:
                self._peer_death_first()
                ctx = self.contexts[tp]
                raise WorkerError(ctx.dp_rank, tp, ctx.node_id, method, str(reply.value))
        return [r.value for r in replies]

    def _peer_death_first(self) -> None:
        """A worker's error in a collective is most often its peer's death (gloo: 'connection reset by peer'):
        the monitor gets a moment to report one, and a death found is the rank's cause, not the echo."""
        deadline = time.monotonic() + MONITOR_GRACE_S
        while self._dead is None and time.monotonic() < deadline:
            time.sleep(0.005)
        self.check_health()
