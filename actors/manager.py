"""``ActorManager``: the Ray backend, one cluster's actors started, watched and torn down.

It builds a :class:`~raydp.actors.runtime.RayRuntime` and runs the shared
control sequences (:class:`~raydp.orchestration.core.Orchestrator`) over it:
placement, the coordinator and engine core actors, the startup handshake,
then every ``run()`` ref watched on a background thread with ``ray.wait`` at
a short timeout, so a death is reported within a fraction of a second as a
typed :class:`~raydp.errors.ComponentDeadError` and handed to its restart
policy. Everything it creates is recorded in an :class:`~raydp.actors.owned.Owned`
that ``close()``, garbage collection and interpreter exit all release, once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup

from raydp.actors.api_servers import HostsRemoteAPIServers
from raydp.actors.owned import Owned
from raydp.actors.runtime import RayRuntime
from raydp.backend import DeathListener, MovedListener, RestartListener, ScaleListener
from raydp.config import RaydpConfig
from raydp.errors import ComponentDeadError, RaydpError, StartupError
from raydp.orchestration.core import Orchestrator, weak_report
from raydp.orchestration.ranks import RankRecord
from raydp.wire.endpoints import ClusterEndpoints
from raydp.wire.records import APIServerRecord, CoordinatorStatus
from raydp.wire.security import CurveKeys
from raydp.wire.transport import ipc_prefix, socket_options


class ActorManager(HostsRemoteAPIServers):
    """Owns one raydp cluster's actors and groups; see the module docstring."""

    def __init__(
        self,
        config: RaydpConfig,
        *,
        placement_groups: Sequence[PlacementGroup] | None = None,
        progress: Callable[[int, int], None] | None = None,
        engine_cls: type | None = None,
    ) -> None:
        self.config = config
        self._progress = progress
        self.ipc_prefix = ipc_prefix(config.name)
        # Made per launch and handed out only through Ray (actor arguments, endpoints).
        self.curve = CurveKeys.generate() if config.uses_curve else None
        sock_opts = socket_options(config, self.curve)
        self._owned = Owned(name=self.ipc_prefix)
        if not config.detached:  # a detached cluster outlives its launcher: only close() ends it
            weakref.finalize(self, self._owned.collected)  # at garbage collection and at exit
        self.driver_node_id: str = ray.get_runtime_context().get_node_id()
        self.runtime = RayRuntime(
            config,
            self._owned,
            self._owned.ranks,
            driver_node_id=self.driver_node_id,
            ipc_prefix=self.ipc_prefix,
            sock_opts=sock_opts,
            curve=self.curve,
            engine_cls=engine_cls,
            user_groups=placement_groups,
        )
        self.orchestrator = Orchestrator(
            config,
            self.runtime,
            self._owned,
            driver_node_id=self.driver_node_id,
            ipc_prefix=self.ipc_prefix,
            sock_opts=sock_opts,
            curve=self.curve,
            table=self._owned.ranks,
            threads=self._owned.restarts,
        )
        # A weak reference, so the running watcher does not keep this manager alive:
        # dropping the last handle must still close the cluster.
        self.runtime.report = weak_report(self.orchestrator)

    # ---- public ------------------------------------------------------------------

    @property
    def endpoints(self) -> ClusterEndpoints | None:
        return self.orchestrator.endpoints

    @property
    def slots(self) -> tuple[RankRecord, ...]:
        """Where each rank runs (group, node, devices), by rank."""
        return tuple(self.orchestrator.table)

    @property
    def engines(self) -> tuple[Any, ...]:
        """Engine actor handles by rank (read-only)."""
        return tuple(self.orchestrator.table.handles())

    @property
    def coordinator(self) -> Any:
        return self._owned.coordinator

    @property
    def dp_size(self) -> int:
        return len(self.orchestrator.table)

    @property
    def deaths(self) -> list[ComponentDeadError]:
        return list(self.orchestrator.reports.deaths)

    def coordinator_state(self) -> CoordinatorStatus:
        """The coordinator's wave, running flag and counts."""
        return self.runtime.coordinator_state()

    def register_api_servers(self, record: APIServerRecord) -> None:
        self.runtime.api_server_records.append(record)
        self.runtime.tell_coordinator(self._owned.coordinator.add_api_servers.remote(record), "the API servers")

    def on_death(self, listener: DeathListener) -> None:
        self.orchestrator.reports.on_death(listener)

    def on_restart(self, listener: RestartListener) -> None:
        """Called with the new endpoint once a dead rank has been restarted and rejoined."""
        self.orchestrator.reports.on_restart(listener)

    def on_coordinator_moved(self, listener: MovedListener) -> None:
        """Called with the cluster's endpoints once its coordinator restarted on another node."""
        self.orchestrator.reports.on_coordinator_moved(listener)

    def on_scale(self, listener: ScaleListener) -> None:
        """Called with ``(endpoints, size, drain_timeout_s)`` at each step of a scale change."""
        self.orchestrator.scale_listeners.append(listener)

    def scale(self, dp_size: int, drain_timeout_s: float, pool: str | None = None) -> ClusterEndpoints:
        """Grow or shrink to ``dp_size`` ranks, or ``pool`` to ``dp_size`` (see :mod:`raydp.orchestration.scaling`)."""
        return self.orchestrator.scale(dp_size, drain_timeout_s, pool)

    def start(self) -> ClusterEndpoints:
        """Create everything and wait for it; on any failure release it all and raise."""
        try:
            return self.orchestrator.start(self._progress)
        except RaydpError:
            self.close()
            raise
        except Exception as exc:  # a raw Ray error (e.g. a get timeout) becomes a typed one
            self.close()
            raise StartupError(f"cluster {self.config.name!r} failed to start: {exc!r}") from exc
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop watching, shut the actors down, remove created groups. Idempotent."""
        self._owned.release()
