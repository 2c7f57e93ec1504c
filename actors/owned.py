"""What a cluster created and must release: released once, by close, GC or exit."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raydp.orchestration.owned import OwnedResources
from raydp.orchestration.ranks import RankTable
from raydp.placement.groups import remove_groups
from raydp.wire.transport import remove_cluster_ipc_dirs

logger = logging.getLogger("raydp.manager")
GRACE_S = 3.0


@dataclass
class Owned(OwnedResources):
    """The Ray side of a launch: actors, placement groups, watcher and restart threads."""

    coordinator: Any = None
    ranks: RankTable = field(default_factory=RankTable)  # the engines are the ranks' handles
    engines: list[Any] = field(default_factory=list)  # engines found by name (ending another's cluster)
    groups: list[PlacementGroup] = field(default_factory=list)
    watcher: threading.Thread | None = None
    run_refs: list[Any] = field(default_factory=list)
    restarts: list[threading.Thread] = field(default_factory=list)
    nodes: set[str] = field(default_factory=set)

    def stop_components(self) -> None:
        for thread in [self.watcher, *self.restarts]:
            # A restart sees the stop flag within one poll and gives up its sockets.
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=2)
        if ray.is_initialized():
            self._stop_actors()
            remove_groups(self.groups)
            self._sweep_socket_dirs()
        self.groups.clear()

    def _stop_actors(self) -> None:
        """Ask politely, let each actor exit on its own, then kill what is left.

        A signal from Ray landing while an actor tears down its sockets prints
        ``Exception ignored in: Context.__del__ ... SystemExit`` tracebacks:
        so the loops leave first (their ``run`` refs end), then each actor exits
        from inside (``__ray_terminate__``), and only a wedged one is killed.
        """
        actors = [a for a in [self.coordinator, *self.engines, *self.ranks.handles()] if a is not None]
        _wait([a.shutdown.remote() for a in actors] + self.run_refs)
        _wait([a.__ray_terminate__.remote() for a in actors])
        for actor in actors:
            _kill(actor)
        # Wait for the deaths, so their resources are back when close() returns
        # and an immediate relaunch finds the cluster as it was.
        _wait(self.run_refs)
        self.run_refs.clear()
        self.engines.clear()
        self.coordinator = None

    def _sweep_socket_dirs(self) -> None:
        """Killed actors cannot remove their IPC directories: do it on each node."""
        if not self.name:
            return
        here = ray.get_runtime_context().get_node_id()
        refs = [
            remove_ipc_dirs.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
                self.name
            )
            for node in self.nodes - {here}
        ]
        remove_cluster_ipc_dirs(self.name)
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=GRACE_S)


def _remove_ipc_dirs(cluster_name: str) -> None:
    remove_cluster_ipc_dirs(cluster_name)


remove_ipc_dirs = ray.remote(num_cpus=0)(_remove_ipc_dirs)


def _wait(refs: list[Any]) -> None:
    """Until every ref is done (a dead actor's counts as done), at most ``GRACE_S``."""
    if not refs:
        return
    try:
        ray.wait(refs, num_returns=len(refs), timeout=GRACE_S)
    except Exception:  # a dead actor's ref may raise; it is being killed anyway
        pass


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception as exc:  # already dead, or Ray is going down
        logger.debug("kill failed: %r", exc)
