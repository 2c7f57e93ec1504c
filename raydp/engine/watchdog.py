"""A rank's progress watchdog: it runs the loop on a thread of its own and watches it from the host's.

The loop stamps the start of each turn (one turn: take inputs, at most one
step, send its outputs) with a plain attribute store, so the step path pays
one clock read and nothing else. The watching thread, the one that called
``run()``, wakes every :data:`CHECK_INTERVAL_S` (a quarter of the timeout at
most) and reads that stamp. A turn older than ``step_timeout_s`` means the
rank is *hung*: blocked in ``step()``, a dummy batch, a collective of its
gang, or an engine call that never returns. An idle rank's turns end within
the loop's one-second poll, so an idle rank is never hung; a slow step that
finishes inside the bound is never hung either.

On a hang the watcher takes the loop thread's Python stack with
``sys._current_frames`` (the stdlib's own view, in-process: py-spy would need
ptrace rights and its binary on every node, faulthandler writes to a file
descriptor rather than returning text) and raises
:class:`~raydp.errors.EngineHungError` from ``run()``, which reports the rank
dead the way any engine failure does. The stuck thread cannot be stopped; the
host's process is ended by its backend (the restart policy or close).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Protocol

from raydp.errors import EngineHungError, StartupError

CHECK_INTERVAL_S = 0.25
PEERS_NEVER_JOINED = "waiting for a DP all-reduce round its peers never joined"


class PeerWait(Protocol):
    """What a lockstep rank waits for from its peers: the all-reduce round it started (None: none)."""

    round_started: float | None


class TurnClock:
    """When the loop's turn in flight began, and how many steps it completed (written by the loop only).

    ``peers`` is the lockstep rank, for a rank that has one: its turns go on (dummy steps) while it
    waits for a round of the DP all-reduce, so a round its peers never join shows there, not in a turn.
    """

    __slots__ = ("peers", "steps", "turn_started")

    def __init__(self) -> None:
        self.turn_started = time.monotonic()
        self.steps = 0
        self.peers: PeerWait | None = None

    def age(self, now: float) -> float:
        return now - self.turn_started

    def peer_wait(self, now: float) -> float:
        """How long the all-reduce round in flight has waited for the peers (0: none in flight)."""
        started = self.peers.round_started if self.peers is not None else None
        return 0.0 if started is None else now - started


def run_watched(
    run: Callable[[], None],
    clock: TurnClock,
    step_timeout_s: float | None,
    hung: Callable[[float, str], EngineHungError],
    name: str,
) -> None:
    """Run ``run`` on a thread named ``name`` and wait for it; re-raise what it raised.

    Raises ``hung(seconds, stack)`` instead once a turn outlives
    ``step_timeout_s`` (None: never, the loop is only waited for).
    """
    failure: list[BaseException] = []

    def body() -> None:
        try:
            run()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=body, name=name, daemon=True)  # daemon: a stuck one must not hold the exit
    thread.start()
    interval = CHECK_INTERVAL_S if step_timeout_s is None else min(CHECK_INTERVAL_S, step_timeout_s / 4)
    while thread.is_alive():
        thread.join(interval)
        now = time.monotonic()
        age, waited = clock.age(now), clock.peer_wait(now)
        if step_timeout_s is None or not thread.is_alive() or max(age, waited) <= step_timeout_s:
            continue
        if age >= waited:
            raise hung(age, stack_of(thread))
        raise hung(waited, f"{PEERS_NEVER_JOINED} (its loop turns on, in:)\n{stack_of(thread)}")
    if failure:
        raise failure[0]


def stack_of(thread: threading.Thread) -> str:
    """``thread``'s Python stack, innermost frame last (as a traceback prints it)."""
    frame = sys._current_frames().get(thread.ident or -1)  # noqa: SLF001 - the stdlib's documented API
    return "".join(traceback.format_stack(frame)) if frame is not None else "(the thread has ended)\n"


@contextlib.contextmanager
def startup_deadline(timeout_s: float, who: str) -> Iterator[None]:
    """Raise :class:`~raydp.errors.StartupError` with the stuck stack if the block outlives ``timeout_s``.

    A rank's engine is built on its process's main thread (vLLM's model load,
    its KV-cache profiling), so the deadline is a ``SIGALRM`` there: its
    handler runs on that thread, between two bytecodes or when a blocking
    call returns with EINTR, with the stuck frame in hand. A call that never
    returns to Python (a C loop that retries EINTR) is not interrupted; the
    launcher's own, later deadline still fails the launch then. Off the main
    thread (where signals cannot be set) the block runs unwatched.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)\n"
        raise StartupError(f"{who} did not start within startup_timeout_s={timeout_s:g}; it was in:\n{stack}")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
