"""The engine core interface users implement, and how engine classes are loaded by path.

An engine core is a stateful step loop that owns its rank's devices. raydp
calls it from one thread at a time: it is built on its process's main
thread, then driven from its rank's loop thread only (requests and aborts
arrive between steps),
``step()`` advances every running request by one iteration and returns what it
produced. Implementations need not be thread-safe.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from raydp.engine.executor import Executor
from raydp.errors import ConfigError
from raydp.wire.protocol import Output, Request


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
    # A private (0700) directory of the rank's, for files of its own: removed with the rank, a killed
    # one's at the next sweep of its node's raydp directories or at the cluster's close. None: none given.
    scratch_dir: str | None = None


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
    ``cache_events(full: bool) -> CacheEvents | None`` reports the engine's
    prefix cache for ``balancer="prefix"``: the blocks stored and evicted
    since the last call, named by :func:`raydp.wire.blocks.block_digest`, and
    the prompt tokens looked up and found (None: nothing changed, or no
    cache); with ``full``, everything it holds. See
    :mod:`raydp.engine.cache_report`. ``adapters() -> AdapterState | None``
    reports the LoRA adapters it holds, least recently used first, with its
    slots and load, eviction and hit counts (None: it serves none), for
    adapter-aware routing; see :mod:`raydp.engine.adapter_report`. A
    class attribute ``preload_modules`` (module names) lets the mp backend
    fork the engine's processes from a server that has imported them, on
    machines without a GPU driver (:func:`raydp.fork_server.child_context`):
    for engines whose imports cost more than their start.
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


def preload_modules(cls: object) -> tuple[str, ...]:
    """The modules an engine or worker class asks its processes' fork server to import (none by default)."""
    return tuple(getattr(cls, "preload_modules", ()))


def check_engine_class(obj: Any, label: str) -> Callable[..., EngineCore]:
    """``obj`` if it is a class with every engine core method; ConfigError naming what is missing."""
    missing = [
        m
        for m in ("add_request", "abort", "step", "has_unfinished", "load", "execute_dummy_batch", "shutdown")
        if not hasattr(obj, m)
    ]
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
