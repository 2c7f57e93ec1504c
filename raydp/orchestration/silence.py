"""Ending a rank frozen whole: :class:`SilenceWatch`.

A rank's watchdog (:mod:`raydp.engine.watchdog`) runs in the rank's own
process, so it stops with the loop it watches when the whole process stops:
a SIGSTOP, or native code that holds the GIL and never lets the watchdog's
thread run. Only something outside can see that. Every rank speaks to the
coordinator at least every second while its loop turns, and the coordinator
keeps when it last heard from each (:mod:`raydp.coordinator.silence`).

Protocol: every second (a quarter of the bound, if that is less) the watch
reads the coordinator's status. A rank silent past ``config.silence_bound_s``
(by default ``step_timeout_s`` + 60 s: longer than any step may run without a
word, and longer than Ray takes to find a cut-off node dead, so a partition
stays the node death it is) is frozen. The watch notes it in
``Controls.frozen`` and kills the process; the rank's own watcher then reports
that end, the only report of it, which the note turns into an
:class:`~raydp.errors.EngineHungError` whose ``where`` says the rank went
silent. From there it is any hang: its streams migrate, and the restart
policy starts a successor or leaves the rank down.

Skipped while a lockstep gang is held (its ranks re-form their DP group),
while a scale change runs (it holds the scale lock, which the watch takes
while it ends a rank), and for ranks already reported dead. A rank counts
from its first word to the coordinator in office, so one that freezes
before it (while starting, or before it reaches a restarted coordinator) is
not seen here. A missed reading is tried again at the next check.
"""

from __future__ import annotations

import logging
import threading
import time

from raydp.errors import EngineHungError
from raydp.orchestration.controls import Controls, tick_while_alive

logger = logging.getLogger("raydp.manager")

CHECK_EVERY_S = 1.0
WHERE = (
    "(no stack: the rank's process said nothing for {:.1f}s, its watchdog's thread included; it is stopped, "
    "or native code holds the GIL)"
)


class SilenceWatch:
    """Ends ranks the coordinator has not heard from for ``bound_s`` as hung; see the module docstring.

    ``scale_lock`` is the orchestrator's: a rank is never ended in the middle of a scale change.
    """

    def __init__(self, controls: Controls, bound_s: float, scale_lock: threading.Lock) -> None:
        self.c = controls
        self.bound_s = bound_s
        self.scale_lock = scale_lock

    def start(self) -> None:
        """Check on a thread that holds this watch weakly (whoever started it keeps it)."""
        interval = min(CHECK_EVERY_S, self.bound_s / 4)
        tick_while_alive(self, SilenceWatch.check, interval, self.c.owned.stop, "raydp-silence-watch")

    def check(self) -> list[int]:
        """One round: the ranks it ended."""
        if self.scale_lock.locked():
            return []
        status = self.c.rt.coordinator_state()
        if status.hold is not None:
            return []
        silent = status.silent_s
        frozen = [r for r, s in enumerate(silent) if s > self.bound_s and r not in status.dead]
        return [rank for rank in frozen if self.end(rank, silent[rank])]

    def end(self, rank: int, silent_s: float) -> bool:
        c = self.c
        if not self.scale_lock.acquire(blocking=False):
            return False
        try:
            with c.report_lock:
                if c.closing() or rank not in c.table or rank in c.reports.dead:
                    return False
                record = c.table[rank]
                hung = EngineHungError(rank, record.node_id, silent_s, WHERE.format(silent_s))
                c.frozen[rank] = (time.monotonic(), hung.detail_text())
            logger.error(
                "engine rank %d on node %s: nothing heard from it for %.1fs (bound %.1fs); ending it as hung",
                rank,
                record.node_id[:12],
                silent_s,
                self.bound_s,
            )
            c.rt.kill([record])  # its watcher reports the end, which the note names
            return True
        finally:
            self.scale_lock.release()
