"""Ending a rank frozen whole: :class:`SilenceWatch`.

A rank's watchdog (:mod:`raydp.engine.watchdog`) runs in the rank's own
process, so it stops with the loop it watches when the whole process stops:
a SIGSTOP, or native code that holds the GIL and never lets the watchdog's
thread run. Only something outside can see that. Every rank speaks to the
coordinator at least every second while its loop turns, and the coordinator
keeps when it last heard from each (:mod:`raydp.coordinator.silence`).

Protocol: every :data:`CHECK_EVERY_S` the watch reads the coordinator's
status. A rank silent past ``config.silence_bound_s`` (by default
``step_timeout_s`` + 60 s: longer than any step may run without a word, and
longer than Ray takes to find a cut-off node dead, so a partition stays the
node death it is) is ended as hung: its watched end is retired (its process
dying is this report's doing, not one more death), and it is reported as an
:class:`~raydp.errors.EngineHungError` whose ``where`` says it went silent.
From there it is any hang: its streams migrate, the restart policy ends the
process and starts a successor, or leaves the rank down.

Skipped while a lockstep gang is held (its ranks re-form their DP group), while
a restarted coordinator relearns the ranks, while a scale change runs, and for
ranks already reported dead. A missed reading (the coordinator restarting) is
tried again at the next check.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from raydp.errors import DeathCause, EngineHungError
from raydp.orchestration.controls import Controls

logger = logging.getLogger("raydp.manager")

CHECK_EVERY_S = 1.0
WHERE = (
    "(no stack: the rank's process said nothing for {:.1f}s, its watchdog's thread included; it is stopped, "
    "or native code holds the GIL)"
)


class SilenceWatch:
    """Reports ranks the coordinator has not heard from for ``bound_s`` as hung; see the module docstring."""

    def __init__(self, controls: Controls, bound_s: float, busy: Callable[[], bool] = lambda: False) -> None:
        self.c = controls
        self.bound_s = bound_s
        self.busy = busy  # whether a scale change runs
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name="raydp-silence-watch", daemon=True)
        self.thread.start()

    def run(self) -> None:
        stop = self.c.owned.stop
        while not stop.wait(min(CHECK_EVERY_S, self.bound_s / 4)):
            try:
                self.check()
            except Exception as exc:
                logger.debug("silence watch: no reading this round: %r", exc)

    def check(self) -> list[int]:
        """One round: the ranks it ended."""
        if self.busy():
            return []
        status = self.c.rt.coordinator_state()
        if status.hold is not None or not status.resynced:
            return []
        silent = status.silent_s
        frozen = [r for r, s in enumerate(silent) if s > self.bound_s and r not in status.dead]
        return [rank for rank in frozen if self.end(rank, silent[rank])]

    def end(self, rank: int, silent_s: float) -> bool:
        c = self.c
        with c.report_lock:
            if c.closing() or rank not in c.table or rank in c.reports.dead:
                return False
            record = c.table[rank]
            logger.error(
                "engine rank %d on node %s: nothing heard from it for %.1fs (bound %.1fs); ending it as hung",
                rank,
                record.node_id[:12],
                silent_s,
                self.bound_s,
            )
            c.rt.retire([record])
            hung = EngineHungError(rank, record.node_id, silent_s, WHERE.format(silent_s))
            c.report(rank, DeathCause.HUNG, hung.detail_text())
        return True
