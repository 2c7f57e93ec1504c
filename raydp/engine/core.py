"""The engine core interface users implement, and the built-in :class:`EchoEngine`.

An engine core is a stateful step loop that owns its rank's devices. raydp
calls it from one thread only: requests and aborts arrive between steps,
``step()`` advances every running request by one iteration and returns what it
produced. Implementations need not be thread-safe.
"""

from __future__ import annotations

import importlib
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from raydp.engine.executor import Executor
from raydp.errors import ConfigError
from raydp.wire.protocol import Output, Request
from raydp.wire.sampling import unsupported


@dataclass(frozen=True)
class EngineContext:
    """What an engine core learns about its place in the cluster at construction."""

    rank: int
    local_rank: int
    dp_size: int
    world_size: int
    node_id: str
    device_ids: tuple[str, ...] = ()
    # The rank's device workers, when the engine class names a ``worker_class``
    # (see raydp.engine.executor); None otherwise.
    executor: Executor | None = None


@runtime_checkable
class EngineCore(Protocol):
    """What raydp needs from a user's engine core.

    Constructed as ``cls(context, **engine_kwargs)``. Optional extras:
    ``capacity() -> int`` (summed by the handshake, e.g. KV blocks; 0 if absent),
    ``work() -> int``, the tokens the engine has left to generate for its
    requests, waiting and running (``max_tokens`` bounds each; between ranks
    with even request counts clients pick the one with the least work, so a
    rank busy with long requests is told from one busy with short ones), and,
    in lockstep mode, ``attach_dp_group(group)``, called once before the loop
    starts with the DP ``torch.distributed`` (gloo) process group, so the
    engine's forward pass can run collectives over it. It may return False
    when this engine will run none (anything else, ``None`` included, means it
    does): ranks whose steps all-reduce step together, and then take the
    wave's all-reduce at agreed steps rather than whenever it arrives.
    """

    def add_request(self, request: Request) -> None: ...

    def abort(self, request_ids: Sequence[str]) -> None: ...

    def step(self) -> list[Output]: ...

    def has_unfinished(self) -> bool: ...

    def load(self) -> tuple[int, int]:
        """``(waiting, running)`` request counts, published for load balancing."""
        ...

    def execute_dummy_batch(self) -> None: ...

    def shutdown(self) -> None: ...


def load_engine_class(path: str) -> Callable[..., EngineCore]:
    """Import ``'package.module:Class'`` and check it looks like an engine core."""
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"engine={path!r}: cannot import it ({exc})") from None
    return check_engine_class(obj, path)


def check_engine_class(obj: Any, label: str) -> Callable[..., EngineCore]:
    """``obj`` if it is a class with every engine core method; ConfigError naming what is missing."""
    missing = [m for m in ("add_request", "abort", "step", "has_unfinished", "load",
                           "execute_dummy_batch", "shutdown") if not hasattr(obj, m)]
    if not isinstance(obj, type) or missing:
        raise ConfigError(f"engine={label!r}: not an engine core class (missing {missing})")
    return obj


def engine_path(engine: str | type) -> str:
    """The ``module:Class`` path of an engine given as a path or a class."""
    if isinstance(engine, str):
        return engine
    # A class defined in a function or a notebook cell has no import path; the
    # label still names it (the class itself travels to the actors through Ray).
    return f"{engine.__module__}:{engine.__qualname__.replace('<locals>.', '')}"


class EchoEngine:
    """Echoes each prompt back one token per step, ``max_tokens`` tokens in all.

    ``max_running`` bounds the running batch (the rest waits), so load numbers
    mean what they do in a real inference engine. ``step_delay_s`` makes each
    step sleep, to stand in for device time in tests and benchmarks. With
    ``collective=True`` every step and dummy batch all-reduces a tensor over
    the DP group, as an expert-parallel forward pass does: a rank missing from
    a step would hang its peers.
    """

    def __init__(
        self,
        context: EngineContext,
        max_running: int = 256,
        step_delay_s: float = 0.0,
        collective: bool = False,
    ) -> None:
        self.context = context
        self.max_running = max_running
        self.step_delay_s = step_delay_s
        self.collective = collective
        self._dp_group: Any = None
        self.collectives = 0
        self.last_work_step = 0
        self._waiting: OrderedDict[str, Request] = OrderedDict()
        self._running: dict[str, tuple[Request, int]] = {}
        self.steps = 0
        self.dummy_steps = 0

    def capacity(self) -> int:
        return self.max_running

    def add_request(self, request: Request) -> None:
        if request.sampling is not None and (why := unsupported("EchoEngine", request.sampling, ("ignore_eos",))):
            raise ConfigError(why)  # fails this request alone, naming the field
        self._waiting[request.request_id] = request

    def abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._waiting.pop(rid, None)
            self._running.pop(rid, None)

    def attach_dp_group(self, group: Any) -> bool:
        """Called by the engine loop in lockstep mode with the DP process group.

        Returns whether the forward pass runs collectives over it (then the
        ranks collect their wave all-reduce at agreed steps).
        """
        import torch

        self._dp_group = group
        self._ones = torch.ones(1)  # the forward pass's stand-in collective payload
        return self.collective

    def _forward(self) -> None:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if self.collective and self._dp_group is not None:
            import torch.distributed as dist

            dist.all_reduce(self._ones, group=self._dp_group)
            self.collectives += 1

    def step(self) -> list[Output]:
        self._admit()
        self.steps += 1
        self.last_work_step = self.steps + self.dummy_steps
        self._forward()
        outputs = []
        for rid, (req, done) in list(self._running.items()):
            prompt = req.prompt_token_ids or [0]
            token = prompt[done % len(prompt)]
            finished = done + 1 >= req.max_tokens
            outputs.append(Output(rid, [token], finished, "length" if finished else None))
            if finished:
                del self._running[rid]
            else:
                self._running[rid] = (req, done + 1)
        return outputs

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_running:
            rid, req = self._waiting.popitem(last=False)
            self._running[rid] = (req, 0)

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    def load(self) -> tuple[int, int]:
        return len(self._waiting), len(self._running)

    def work(self) -> int:
        waiting = sum(req.max_tokens for req in self._waiting.values())
        return waiting + sum(req.max_tokens - done for req, done in self._running.values())

    def execute_dummy_batch(self) -> None:
        self.dummy_steps += 1
        self._forward()

    def shutdown(self) -> None:
        self._waiting.clear()
        self._running.clear()

    def describe(self) -> dict[str, Any]:
        """Where this rank runs and which devices it sees (called as a utility)."""
        return {
            "rank": self.context.rank,
            "node_id": self.context.node_id,
            "pid": os.getpid(),
            "device_ids": list(self.context.device_ids),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    def stats(self) -> dict[str, int]:
        """Counters for tests and the demo summary (called as a utility)."""
        return {
            "steps": self.steps,
            "dummy_steps": self.dummy_steps,
            "collectives": self.collectives,
            "last_work_step": self.last_work_step,
            "dp_group_size": self._group_size(),
        }

    def _group_size(self) -> int:
        """How many ranks the collective runs over (0 without a DP group)."""
        if self._dp_group is None:
            return 0
        import torch.distributed as dist

        return int(dist.get_world_size(self._dp_group)) if dist.is_initialized() else 0

