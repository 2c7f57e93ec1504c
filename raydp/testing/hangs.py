"""Engines that hang on purpose, for the watchdog's tests and the chaos soak (no Ray: the mp backend loads them too).

:class:`HangingEchoEngine` is the echo engine with one fault: on chosen ranks
it blocks forever in ``step()`` at its Nth step, in ``execute_dummy_batch``
(a lockstep rank's idle step), or while it is built (a startup that wedges).
With ``once_dir`` set, each rank hangs once per directory: the hang leaves a
marker file there, so the rank's successor serves normally, as a restarted
rank does after a transient wedge.

Every hang blocks in :func:`block_forever`, so a watchdog's stack names it.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

from raydp.engine.core import EngineContext
from raydp.models.echo import EchoEngine
from raydp.wire.protocol import Output

HangPoint = Literal["step", "dummy", "startup"]


def block_forever() -> None:
    """Never returns: the innermost Python frame of a hung rank in these tests."""
    while True:
        time.sleep(3600)


class HangingEchoEngine(EchoEngine):
    """An echo engine that hangs in ``hang_in`` on ``ranks`` (all when None) at its ``hang_at_step``-th call."""

    engine_name = "HangingEchoEngine"

    def __init__(
        self,
        context: EngineContext,
        hang_in: HangPoint = "step",
        hang_at_step: int = 1,
        ranks: list[int] | None = None,
        once_dir: str | None = None,
        **echo: Any,
    ) -> None:
        if hang_in not in ("step", "dummy", "startup"):
            raise ValueError(f"hang_in={hang_in!r}: must be 'step', 'dummy' or 'startup'")
        if hang_at_step < 1:
            raise ValueError(f"hang_at_step={hang_at_step!r}: must be an int >= 1")
        super().__init__(context, **echo)
        self.hang_in, self.hang_at = hang_in, hang_at_step
        self._armed = ranks is None or context.rank in ranks
        self._marker = Path(once_dir) / f"hung-dp{context.rank}" if once_dir else None
        self._calls = 0
        if hang_in == "startup":
            self._maybe_hang()

    def _maybe_hang(self) -> None:
        self._calls += 1
        if not self._armed or self._calls != self.hang_at:
            return
        if self._marker is not None:
            if self._marker.exists():
                return
            self._marker.touch()
        block_forever()

    def step(self) -> list[Output]:
        if self.hang_in == "step":
            self._maybe_hang()
        return super().step()

    def execute_dummy_batch(self) -> None:
        if self.hang_in == "dummy":
            self._maybe_hang()
        super().execute_dummy_batch()
