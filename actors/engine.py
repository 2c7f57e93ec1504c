"""``EngineCoreActor``: one DP rank as a Ray actor around :class:`~raydp.engine.host.EngineHost`."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import ray

from raydp.actors.metrics import EngineMetrics, export_periodically
from raydp.actors.workers import RayExecutor
from raydp.config import RaydpConfig
from raydp.engine.host import EngineHost, preload
from raydp.errors import EngineHungError
from raydp.processes import set_process_title
from raydp.wire.endpoints import CoordinatorEndpoints
from raydp.wire.security import CurveKeys

HUNG_EXIT_DELAY_S = 5.0
HUNG_EXIT_CODE = 70  # EX_SOFTWARE


class EngineCoreActor:
    """One DP rank. Requests and outputs travel over ZMQ; these Ray methods are control only.

    Methods:

    * construction builds the user's engine core; its exception, with the
      traceback, becomes the actor's death cause, which ``launch()`` shows;
    * ``wait_for_init()`` -> ``{rank, node_id, pid}`` once constructed;
    * ``dp_master(dp_size=None)`` -> ``"ip:port"`` for the gloo rendezvous (asked of rank 0;
      with ``dp_size``, a new one for the DP group a scale change forms);
    * ``counters()`` -> requests ``added``, ``finished`` and ``aborted`` (a scale-down drains on them);
    * ``follow_coordinator(endpoints)`` -> whether the running loop will reconnect to a coordinator
      that moved to another node;
    * ``run(handshake_addresses)``: the handshake, then the
      engine loop until Shutdown;
    * ``shutdown()`` wakes and stops the loop from another thread; never blocks.

    States: constructed -> handshaking -> running -> stopped. A thread exports
    the loop's request counters as the Ray metric ``raydp_engine_requests``. The actor is
    threaded (``max_concurrency``) so control calls reach it while ``run`` loops.

    Failures: ``run`` returns only after a clean shutdown and raises the
    engine's exception if a step fails (every in-flight request gets an error
    output first), or :class:`~raydp.errors.EngineHungError` if a loop turn
    outlives ``step_timeout_s`` (the process then exits by itself a few
    seconds later). The manager watches the ``run`` ref, so any death (killed,
    process or node died, engine error, hang) is reported as ``EngineDeadError``.
    """

    def __init__(
        self,
        config: RaydpConfig,
        rank: int,
        local_rank: int,
        frontend_node_id: str,
        device_ids: tuple[str, ...] | DeviceProbe = (),
        ipc_prefix: str = "",
        engine_cls: type | None = None,
        curve: CurveKeys | None = None,
    ) -> None:
        node_id = ray.get_runtime_context().get_node_id()
        if isinstance(device_ids, DeviceProbe):
            preload(config)  # the slow imports first: the probe finishes meanwhile
            device_ids = device_ids.resolve(config.component_start_s)
        self.host = EngineHost(
            config,
            rank,
            local_rank,
            node_id,
            frontend_node_id,
            device_ids,
            ipc_prefix,
            engine_cls,
            curve,
            executor_factory=RayExecutor,
        )
        self._metrics_stop = threading.Event()
        export_periodically(self.host.counters, EngineMetrics(config.name, rank).export, self._metrics_stop)

    def __repr__(self) -> str:
        # Ray prefixes this actor's log lines with its repr: name the rank and node.
        host = getattr(self, "host", None)  # None while (or because) the constructor failed
        return f"EngineCoreActor({host.tag if host is not None else '?'})"

    def wait_for_init(self) -> dict[str, Any]:
        return {"rank": self.host.rank, "node_id": self.host.node_id, "pid": os.getpid()}

    def dp_master(self, dp_size: int | None = None) -> str:
        return self.host.dp_master(dp_size)

    def counters(self) -> dict[str, int]:
        return self.host.counters()

    def follow_coordinator(self, endpoints: CoordinatorEndpoints) -> bool:
        """The coordinator moved to a live node: reconnect to it (False if this rank's loop is not running)."""
        return self.host.follow_coordinator(endpoints)

    def run(self, handshake_addresses: list[str]) -> None:
        # Ray titles the process after each call it runs; run() is the long one.
        set_process_title(f"raydp::{self.host.tag}")
        try:
            self.host.run(handshake_addresses)
        except EngineHungError:
            # Its loop thread stays stuck, holding the engine's devices. The error must reach the
            # run ref first (Ray sends it as this call returns); then the process goes, freeing them
            # even where no restart policy kills it.
            threading.Timer(HUNG_EXIT_DELAY_S, os._exit, (HUNG_EXIT_CODE,)).start()
            raise

    def shutdown(self) -> None:
        self._metrics_stop.set()
        self.host.shutdown()


@dataclass(frozen=True)
class DeviceProbe:
    """Refs to the device ids of one rank's bundles, which the rank resolves itself.

    Ray waits for an actor's top-level ref arguments before it starts the
    actor, but hands nested ones over as they are: wrapped here, the probe
    runs while the rank's process starts and imports.
    """

    refs: tuple[Any, ...]

    def resolve(self, timeout_s: float) -> tuple[str, ...]:
        return tuple(d for ids in ray.get(list(self.refs), timeout=timeout_s) for d in ids)


def _probe_device_ids(accelerator: str, *after: object) -> list[str]:
    """Run inside one device bundle: which device ids did Ray assign there?

    ``after``: probes this one waits for (Ray runs it once they have finished).
    """
    ids = ray.get_runtime_context().get_accelerator_ids().get(accelerator, [])
    return [str(i) for i in ids]


probe_device_ids = ray.remote(num_cpus=0)(_probe_device_ids)
