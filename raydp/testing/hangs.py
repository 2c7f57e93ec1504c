"""Engines that hang on purpose, for the watchdog's tests and the chaos soak (no Ray: the mp backend loads them too).

:class:`HangingEchoEngine` is the echo engine with one fault: on chosen ranks
it blocks forever in ``step()`` at its Nth step, in ``execute_dummy_batch``
(a lockstep rank's idle step), or while it is built (a startup that wedges;
with ``hang_in="restart"``, every restart of a rank that served wedges once,
and the try after it serves);
or, from its Nth DP all-reduce on, a lockstep rank skips them all, so that
its peers wait in the collective for a rank that never comes.
With ``once_dir`` set, each rank hangs once per directory: the hang leaves a
marker file there, so the rank's successor serves normally, as a restarted
rank does after a transient wedge.

:class:`HangableWorkerEchoEngine` (the chaos soak's engine) hangs on demand:
its ``hang_now`` utility never returns, so the loop turn that runs it never
ends, as a step that blocks does; :class:`HangableEchoEngine` is the same
without device workers (a lockstep gang's, in the failure table).

:class:`HangableVllmEngine` is the same for a real vLLM engine core (the
vLLM chaos soak's). :class:`HangingVllmEngine` is a real vLLM engine core whose model executor
blocks forever in ``execute_model`` at its Nth call on chosen ranks (a worker
stuck in a forward pass, as a rank stuck in a collective looks from its engine).

Every hang but the skipped all-reduce blocks in :func:`block_forever`, so a
watchdog's stack names it; a peer of a skipping rank is stuck in the collective.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from raydp.engine.core import EngineContext
from raydp.models.echo import EchoEngine
from raydp.models.echo_workers import WorkerEchoEngine
from raydp.models.vllm import VllmEngine
from raydp.wire.protocol import Output

HangPoint = Literal["step", "dummy", "startup", "restart", "allreduce"]
HANG_POINTS = ("step", "dummy", "startup", "restart", "allreduce")


def block_forever() -> None:
    """Never returns: the innermost Python frame of a hung rank in these tests."""
    while True:
        time.sleep(3600)


class _HangSwitch:
    """Whether the Nth call of something hangs, on this rank, once per ``once_dir``."""

    def __init__(self, rank: int, hang_at: int, ranks: list[int] | None, once_dir: str | None) -> None:
        if hang_at < 1:
            raise ValueError(f"hang_at_step={hang_at!r}: must be an int >= 1")
        self.hang_at, self._calls = hang_at, 0
        self.armed = ranks is None or rank in ranks
        self._marker = Path(once_dir) / f"hung-dp{rank}" if once_dir else None

    def due(self) -> bool:
        """Count a call; True at the Nth (once per ``once_dir``)."""
        self._calls += 1
        if not self.armed or self._calls != self.hang_at:
            return False
        if self._marker is not None:
            if self._marker.exists():
                return False
            self._marker.touch()
        return True

    def call(self) -> None:
        if self.due():
            block_forever()


def _count_start(directory: Path, rank: int) -> int:
    """This start of ``rank`` is its Nth in ``directory`` (1 for its first): one file per start."""
    for n in range(1, 10_000):
        try:
            (directory / f"start-dp{rank}-{n}").touch(exist_ok=False)
        except FileExistsError:
            continue
        return n
    raise RuntimeError(f"rank {rank} started 10,000 times in {directory}")


class _Skipped:
    """A collective this rank never joined, as its own loop sees it: done at once."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> None:
        return None


def skip_all_reduces(due: Callable[[], bool]) -> None:
    """From the first DP all-reduce for which ``due()`` is true on, this process contributes to none (its
    peers wait for it).

    It patches this process's DP group only: each rank is a process of its own.
    """
    from raydp.engine import collective

    group = collective.GlooDPGroup
    start, sync = group.start, group.sync
    skipping = [False]

    def skips() -> bool:
        skipping[0] = skipping[0] or due()
        return skipping[0]

    def skipped_start(self: Any, unfinished: bool, hold: bool, pace: int = 0) -> None:
        if not skips():
            return start(self, unfinished, hold, pace)
        self._async_view[:] = (unfinished, hold, pace)
        self._work = _Skipped()
        return None

    def skipped_sync(self: Any, unfinished: bool, hold: bool) -> tuple[bool, bool]:
        return (unfinished, hold) if skips() else sync(self, unfinished, hold)

    group.start = skipped_start  # type: ignore[method-assign]
    group.sync = skipped_sync  # type: ignore[method-assign]


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
        if hang_in not in HANG_POINTS:
            raise ValueError(f"hang_in={hang_in!r}: must be one of {HANG_POINTS}")
        if hang_in == "restart" and once_dir is None:
            raise ValueError("hang_in='restart' needs once_dir: the rank's starts are counted there")
        self._hang = _HangSwitch(context.rank, hang_at_step, ranks, once_dir)
        super().__init__(context, **echo)
        self.hang_in = hang_in
        if hang_in == "startup":
            self._hang.call()
        elif hang_in == "restart" and self._hang.armed and _count_start(Path(str(once_dir)), context.rank) % 2 == 0:
            block_forever()
        elif hang_in == "allreduce":
            skip_all_reduces(self._hang.due)

    def step(self) -> list[Output]:
        if self.hang_in == "step":
            self._hang.call()
        return super().step()

    def execute_dummy_batch(self) -> None:
        if self.hang_in == "dummy":
            self._hang.call()
        super().execute_dummy_batch()


class HangableEchoEngine(EchoEngine):
    """The echo engine, plus utilities that stall a lockstep gang (the failure table's rows): ``hang_now``
    hangs its rank's loop for good; after ``skip_all_reduces_now`` the rank runs on but joins no more DP
    all-reduces, so its peers wait in the collective."""

    def hang_now(self) -> None:
        block_forever()

    def skip_all_reduces_now(self) -> None:
        skip_all_reduces(lambda: True)


class HangableWorkerEchoEngine(WorkerEchoEngine):
    """The echo engine with device workers, plus a utility that hangs its rank's loop for good."""

    def hang_now(self) -> None:
        block_forever()


class HangableVllmEngine(VllmEngine):
    """vLLM's engine core, plus a utility that hangs its rank's loop for good (the vLLM chaos soak's engine)."""

    def hang_now(self) -> None:
        block_forever()


class HangingVllmEngine(VllmEngine):
    """vLLM's engine core whose executor hangs in its ``hang_at_step``-th ``execute_model`` on ``ranks``."""

    HANG_KWARGS = ("hang_at_step", "ranks", "once_dir")

    @classmethod
    def check_engine_kwargs(cls, config: Any) -> None:
        """vLLM's own check, of the kwargs that are vLLM's (the hang's are this class's)."""
        kwargs = {k: v for k, v in config.engine_kwargs.items() if k not in cls.HANG_KWARGS}
        super().check_engine_kwargs(config.with_changes(engine_kwargs=kwargs))

    def __init__(
        self,
        context: EngineContext,
        hang_at_step: int = 3,
        ranks: list[int] | None = None,
        once_dir: str | None = None,
        **engine_kwargs: Any,
    ) -> None:
        switch = _HangSwitch(context.rank, hang_at_step, ranks, once_dir)
        super().__init__(context, **engine_kwargs)
        executor = self.core.model_executor
        execute = executor.execute_model

        def execute_model(*args: Any, **kwargs: Any) -> Any:
            switch.call()
            return execute(*args, **kwargs)

        executor.execute_model = execute_model
