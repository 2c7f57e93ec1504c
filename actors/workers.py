"""A rank's device workers as Ray actors: ``WorkerActor`` and the engine's ``RayExecutor``.

The engine core actor creates one ``WorkerActor`` per device bundle of its
rank's placement group (bundle ``i`` for TP rank ``i``), so Ray assigns each
worker its device, on whichever node the bundle landed (``span`` placement
puts them on several). The workers are the engine actor's children: if it
dies, Ray ends them too.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import zmq
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from raydp.actors.deaths import death_of
from raydp.engine.collective import Rendezvous
from raydp.engine.executor import WorkerContext, WorkerGroupSpec
from raydp.errors import ConfigError, DeathCause, StartupError, WorkerDeadError, WorkerError
from raydp.logs import configure_component_logging
from raydp.names import NAMESPACE, rank_name
from raydp.processes import keep_process_title, set_process_title
from raydp.wire.security import CurveKeys, guard
from raydp.wire.transport import SocketOptions, node_ip
from raydp.workers.channel import ChannelServer, connect_worker
from raydp.workers.executor import ChannelExecutor, DeathHandler
from raydp.workers.runtime import WorkerRuntime, local_device

WATCH_TIMEOUT_S = 0.05
STOP_WAIT_S = 2.0


class WorkerActor:
    """One device worker of one DP rank.

    Methods (control only; steps arrive on the channel):

    * construction learns the worker's devices; TP rank 0's also starts the
      store the rank's device group meets at (so the engine process needs no
      torch: on a restart that is one import of torch fewer competing for the
      node's CPU);
    * ``ready()`` -> ``{node_id, pid, device, device_ids, store}`` (``store``:
      the group's address, from TP rank 0 only);
    * ``join(store)``: join the device group there and build the user's worker
      class; its exception, with the traceback, is what the engine's startup shows;
    * ``call(method, args, kwargs)``: a public method of the worker
      (``Executor.collective_rpc``); an exception comes back as Ray's task error;
    * ``serve(addresses, driver_node_id, curve, max_bytes)``: connect the
      channel and answer steps until STOP or the engine's end closes; the
      engine watches this ref, so the actor's death is seen at once.

    States: constructed -> joined -> serving -> stopped. Threaded (``max_concurrency=2``)
    so that ``call`` reaches it while ``serve`` runs; the engine never sends a
    call while a step is in flight.
    """

    def __init__(self, spec: WorkerGroupSpec, tp_rank: int) -> None:
        node_id = ray.get_runtime_context().get_node_id()
        ids = ray.get_runtime_context().get_accelerator_ids().get(spec.accelerator, [])
        self.spec = spec
        self.label = spec.label(tp_rank, node_id)
        configure_component_logging(self.label)
        set_process_title(f"raydp::{self.label}")
        self.context = WorkerContext(
            spec.dp_rank, tp_rank, spec.world_size, node_id, local_device(spec.accelerator), tuple(str(i) for i in ids)
        )
        import torch.distributed  # noqa: F401  (every worker imports torch now, side by side, not in join())

        # TP rank 0 hosts the group's store, at its node's IP (with span placement, peers may be elsewhere).
        self._rendezvous = Rendezvous(node_ip(), spec.world_size, spec.timeout_s) if tp_rank == 0 else None
        self._runtime: WorkerRuntime | None = None

    def __repr__(self) -> str:
        # Ray prefixes this actor's log lines with its repr.
        return f"WorkerActor({self.label})"

    def ready(self) -> dict[str, Any]:
        ctx = self.context
        store = self._rendezvous.address if self._rendezvous is not None else ""
        return {
            "node_id": ctx.node_id,
            "pid": os.getpid(),
            "device": ctx.device,
            "device_ids": ctx.device_ids,
            "store": store,
        }

    def join(self, store: str) -> None:
        hosted = self._rendezvous.store if self._rendezvous is not None else None
        self._runtime = WorkerRuntime(self.context, self.spec.worker_class, store, self.spec.timeout_s, hosted)

    @property
    def runtime(self) -> WorkerRuntime:
        if self._runtime is None:
            raise RuntimeError(f"{self.label}: has not joined its device group")
        return self._runtime

    def call(self, method: str, args: Any, kwargs: Any) -> Any:
        return self.runtime.call(method, args, kwargs)

    def serve(self, addresses: list[str], driver_node_id: str, curve: CurveKeys | None, max_bytes: int) -> None:
        title = f"raydp::{self.label}"
        set_process_title(title)
        ctx = self.runtime.context
        link = connect_worker(addresses, ctx.tp_rank, ctx.node_id == driver_node_id, curve, max_bytes, ctx.world_size)
        try:
            # Ray retitles the process after every other call ends (collective_rpc): restore ours.
            self.runtime.serve(link, on_idle=lambda: keep_process_title(title))
        finally:
            self.runtime.close()


class RayExecutor(ChannelExecutor):
    """The workers of the rank whose engine actor constructs it; see the module docstring."""

    def __init__(self, spec: WorkerGroupSpec, on_death: DeathHandler | None = None, group: Any = None) -> None:
        """``group``: the rank's placement group (default: the one this actor runs in)."""
        group = group or ray.util.get_current_placement_group()
        if group is None:
            raise ConfigError(f"engine rank {spec.dp_rank}: device workers need the rank's placement group")
        self.spec = spec
        self._incarnation = secrets.token_hex(3)
        self.actors = [self._create(group, tp) for tp in range(spec.world_size)]
        self._refs: dict[Any, int] = {}
        self._zmq: zmq.Context[zmq.Socket[bytes]] | None = None
        self._gate: Any = None
        try:
            infos = self._wait_ready()
            self._join(infos[0]["store"])
            super().__init__(_contexts(spec, infos), on_death)
            self._connect(any(i["node_id"] != spec.node_id for i in infos))
        except BaseException:
            self._stop_workers(graceful=False)
            raise
        threading.Thread(target=self._watch, name=f"raydp-workers-dp{spec.dp_rank}", daemon=True).start()

    def _create(self, group: Any, tp: int) -> Any:
        spec = self.spec
        device = {"num_gpus": 1} if spec.accelerator == "GPU" else {"resources": {spec.accelerator: 1}}
        if spec.accelerator == "CPU":
            device = {"num_cpus": 1}
        return (
            ray.remote(WorkerActor)
            .options(
                num_cpus=device.pop("num_cpus", 0),
                max_concurrency=2,
                **device,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, tp),
                # Named for operators (`ray list actors`); the suffix keeps a restarted
                # rank's workers from colliding with their predecessors while those die.
                name=f"{rank_name(spec.cluster, spec.dp_rank)}-tp{tp}-{self._incarnation}",
                namespace=NAMESPACE,
            )
            .remote(spec, tp)
        )

    def _wait_ready(self) -> list[dict[str, Any]]:
        try:
            return list(ray.get([a.ready.remote() for a in self.actors], timeout=self.spec.timeout_s))
        except RayActorError as exc:
            raise StartupError(f"a device worker of rank {self.spec.dp_rank} failed to start:\n{exc}") from None
        except GetTimeoutError:
            raise StartupError(f"the device workers of rank {self.spec.dp_rank} did not start in time") from None

    def _join(self, store: str) -> None:
        """Every worker joins the group at ``store``; the first failure (with its traceback) fails startup."""
        refs = {a.join.remote(store): tp for tp, a in enumerate(self.actors)}
        pending = list(refs)
        while pending:  # a worker that fails leaves its peers waiting in the group: do not wait for them
            done, pending = ray.wait(pending, timeout=self.spec.timeout_s)
            if not done:
                raise StartupError(
                    f"the device workers of rank {self.spec.dp_rank} did not form their group in {self.spec.timeout_s}s"
                )
            try:
                ray.get(done[0])
            except (RayTaskError, RayActorError) as exc:
                detail = getattr(exc, "traceback_str", None) or str(exc)
                raise StartupError(
                    f"device worker tp{refs[done[0]]} of rank {self.spec.dp_rank} failed to start:\n{detail}"
                ) from None

    def _connect(self, remote: bool) -> None:
        spec = self.spec
        if remote and spec.curve is not None:
            self._zmq = zmq.Context()
            self._gate = guard(self._zmq, spec.curve)
        elif remote:
            self._zmq = zmq.Context()
        server = ChannelServer(
            spec.ipc_dir,
            SocketOptions(max_message_bytes=spec.max_message_bytes, curve=spec.curve),
            remote=remote,
            ctx=self._zmq,
        )
        self._hub = server.hub
        try:
            for tp, actor in enumerate(self.actors):
                ref = actor.serve.remote(server.addresses, spec.node_id, spec.curve, spec.max_message_bytes)
                self._refs[ref] = tp
            self.links = server.accept(spec.world_size, spec.timeout_s, self._check_serving)
        finally:
            server.close_listener()

    def _check_serving(self) -> None:
        done, _ = ray.wait(list(self._refs), timeout=0)
        if done:
            found = death_of(done[0])
            raise StartupError(
                f"worker tp{self._refs[done[0]]} of rank {self.spec.dp_rank} stopped before "
                f"connecting: {found[1] if found else 'it returned'}"
            )

    def _watch(self) -> None:
        refs = dict(self._refs)
        while refs and not self._closing.is_set():
            done, _ = ray.wait(list(refs), timeout=WATCH_TIMEOUT_S)
            for ref in done:
                tp = refs.pop(ref)
                if self._closing.is_set():
                    return
                cause, detail = death_of(ref) or (DeathCause.EXITED, "its serve loop returned")
                self.mark_dead(tp, cause, detail)

    def collective_rpc(
        self,
        method: str,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
        driver_only: bool = False,
    ) -> list[Any]:
        """Control calls go over Ray, not the step channel."""
        self.check_health()
        targets = self.actors[:1] if driver_only else self.actors
        refs = [a.call.remote(method, list(args), dict(kwargs or {})) for a in targets]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        if pending:
            raise TimeoutError(f"{method} on the workers of rank {self.spec.dp_rank} took over {timeout_s}s")
        results, failure = [], None
        for tp, ref in enumerate(refs):  # every ref is read, so Ray logs no unhandled error
            try:
                results.append(ray.get(ref))
            except (RayTaskError, RayActorError) as exc:
                failure = failure or self._worker_failure(tp, method, exc)
        if failure is not None:
            raise failure
        return results

    def _worker_failure(self, tp: int, method: str, exc: Exception) -> Exception:
        ctx = self.contexts[tp]
        if isinstance(exc, RayActorError):
            return WorkerDeadError(ctx.dp_rank, tp, ctx.node_id, DeathCause.UNKNOWN, str(exc))
        return WorkerError(ctx.dp_rank, tp, ctx.node_id, method, getattr(exc, "traceback_str", None) or str(exc))

    def _stop_workers(self, graceful: bool) -> None:
        if graceful and self._refs:  # STOP went out on the channel: give the loops a moment to leave their group
            ray.wait(list(self._refs), num_returns=len(self._refs), timeout=STOP_WAIT_S)
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        hub = getattr(self, "_hub", None)
        if hub is not None:
            hub.sock.close(linger=0)
        if self._gate is not None:
            self._gate.stop()
        if self._zmq is not None:
            self._zmq.destroy(linger=0)


def _contexts(spec: WorkerGroupSpec, infos: list[dict[str, Any]]) -> list[WorkerContext]:
    return [
        WorkerContext(spec.dp_rank, tp, spec.world_size, info["node_id"], info["device"], tuple(info["device_ids"]))
        for tp, info in enumerate(infos)
    ]
