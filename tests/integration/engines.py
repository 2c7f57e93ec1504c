"""Engine cores that misbehave on purpose, for failure tests."""

from __future__ import annotations

from typing import Any

import msgspec

from raydp.engine.core import EngineContext
from raydp.models.echo import EchoEngine
from raydp.models.echo_workers import WorkerEchoEngine
from raydp.wire.protocol import Request


class BrokenConstructorEngine(EchoEngine):
    """Raises in ``__init__`` on one rank, as a bad model load would."""

    def __init__(self, context: EngineContext, bad_rank: int = 0, **kw: Any) -> None:
        if context.rank == bad_rank:
            raise RuntimeError(f"cannot load weights on rank {context.rank}: checksum mismatch")
        super().__init__(context, **kw)


class PoisonEngine(EchoEngine):
    """Its step raises once a request carries token 666, as a device fault would."""

    def step(self) -> list[Any]:
        if any(666 in req.prompt_token_ids for req in self._waiting.values()):
            raise RuntimeError("device fault on a poisoned batch")
        return super().step()


class RankEchoEngine(EchoEngine):
    """Answers every request with its own rank, so a test can see which rank served it."""

    def add_request(self, request: Request) -> None:
        super().add_request(msgspec.structs.replace(request, prompt_token_ids=[self.context.rank]))


class MissingWorkerEngine(WorkerEchoEngine):
    """Names a worker class that cannot be imported: startup must fail, naming it."""

    worker_class = "raydp_nowhere.module:NoWorker"


class PreloadingEchoEngine(EchoEngine):
    """Names a module to preload, so that the ``mp`` backend forks its processes from a fork server."""

    preload_modules = ("email.mime.text",)
