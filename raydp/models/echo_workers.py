"""``WorkerEchoEngine``: the echo engine with device workers, for tests, benchmarks and health checks.

Each step sends the step's request count to every worker over the channel
and checks the driver worker's answer, so the per-step path through real
workers is exercised without a model. ``describe_workers`` (a utility) reports
where each worker runs and which devices it sees.
"""

from __future__ import annotations

from typing import Any

from raydp.engine.core import EngineContext
from raydp.engine.executor import WorkerContext
from raydp.errors import ConfigError
from raydp.models.echo import EchoEngine
from raydp.wire.protocol import Output


class EchoWorker:
    """Answers each step with what it was sent; a worker that does no compute."""

    def __init__(self, context: WorkerContext) -> None:
        self.context = context
        self.steps = 0

    def execute_step(self, step_input: Any) -> Any:
        self.steps += 1
        return step_input

    def describe(self) -> dict[str, Any]:
        return {**self.context.describe(), "steps": self.steps}

    def all_reduce_sum(self, value: float) -> float:
        """Sum ``value`` over the rank's device group: proves the group is formed."""
        import torch
        import torch.distributed as dist

        tensor = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(tensor)
        return float(tensor.item())

    def fail(self, message: str) -> None:
        raise RuntimeError(message)


class WorkerEchoEngine(EchoEngine):
    """:class:`~raydp.models.echo.EchoEngine` whose every step also round-trips its workers."""

    worker_class = "raydp.models.echo_workers:EchoWorker"

    def __init__(self, context: EngineContext, **kwargs: Any) -> None:
        if context.executor is None:
            raise ConfigError("WorkerEchoEngine: needs device workers (context.executor is None)")
        super().__init__(context, **kwargs)
        self.executor = context.executor

    def step(self) -> list[Output]:
        outputs = super().step()
        sent = len(outputs)
        answer = self.executor.execute_step(sent)
        if answer != sent:
            raise RuntimeError(f"driver worker answered {answer!r} to step input {sent!r}")
        return outputs

    def describe_workers(self) -> list[dict[str, Any]]:
        return self.executor.collective_rpc("describe")

    def worker_all_reduce(self, value: float) -> list[float]:
        return self.executor.collective_rpc("all_reduce_sum", [value])

    def fail_worker(self, message: str) -> None:
        """Make every worker raise, to show how a worker's error reaches the caller."""
        self.executor.collective_rpc("fail", [message])
