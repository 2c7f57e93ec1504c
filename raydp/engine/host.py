"""Hosts one rank's engine core in any process: a Ray actor or a local process.

:class:`EngineHost` builds the user's engine core, does the handshake, and runs
the :class:`~raydp.engine.loop.EngineLoop` until shutdown. It knows nothing of
Ray: ``actors/engine.py`` wraps it in a Ray actor, :mod:`raydp.local.manager` in a
spawned process.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from contextlib import ExitStack

import zmq

from raydp.config import RaydpConfig
from raydp.engine.collective import DPCollective, GlooDPGroup, Rendezvous
from raydp.engine.core import EngineContext, check_engine_class, load_engine_class
from raydp.engine.executor import WORKER_CLASS_ATTR, Executor, ExecutorFactory, WorkerGroupSpec
from raydp.engine.lockstep import LockstepRank
from raydp.engine.loop import COUNTERS, EngineLoop
from raydp.engine.sockets import EngineSockets
from raydp.engine.watchdog import run_watched, startup_deadline
from raydp.engine.waves import EngineWaves
from raydp.errors import ConfigError, EngineHungError
from raydp.logs import configure_component_logging
from raydp.wire.control import Regroup
from raydp.wire.endpoints import CoordinatorEndpoints
from raydp.wire.handshake import engine_handshake
from raydp.wire.protocol import Init, Ready
from raydp.wire.security import CurveKeys, guard
from raydp.wire.transport import IpcDir, SocketOptions, bind_inputs, make_socket, node_ip, pick_address, socket_options

logger = logging.getLogger("raydp.engine.core")

# Environment variables that restrict a process to some devices, per Ray resource.
VISIBILITY_ENV = {
    "GPU": "CUDA_VISIBLE_DEVICES",
    "TPU": "TPU_VISIBLE_CHIPS",
    "neuron_cores": "NEURON_RT_VISIBLE_CORES",
}


def preload(config: RaydpConfig) -> None:
    """Import what the rank will need (idempotent).

    A lockstep rank's torch.distributed is a second or more of CPU that rank 0's
    rendezvous and every rank's READY need: spent while the ranks start side by
    side, not one after the other later.
    """
    if config.lockstep:
        import torch.distributed  # noqa: F401


class EngineHost:
    """One rank: constructed -> handshaking -> running -> stopped."""

    def __init__(
        self,
        config: RaydpConfig,
        rank: int,
        local_rank: int,
        node_id: str,
        frontend_node_id: str,
        device_ids: tuple[str, ...] = (),
        ipc_prefix: str = "",
        engine_cls: type | None = None,
        curve: CurveKeys | None = None,
        executor_factory: ExecutorFactory | None = None,
    ) -> None:
        self.config, self.rank, self.node_id = config, rank, node_id
        self._curve = curve
        self.local = node_id == frontend_node_id
        self.tag = f"{config.name} dp{rank} lr{local_rank} node {node_id[:8]}"
        configure_component_logging(self.tag)
        self.ipc_dir = IpcDir(f"{ipc_prefix or config.name}-dp{rank}")
        self._loop: EngineLoop | None = None
        self._failure: BaseException | None = None
        self.on_failure: Callable[[BaseException], None] | None = None  # told when run() is about to raise
        self._stopping = threading.Event()
        self._lock = threading.RLock()  # re-entered by a signal handler on the same thread
        self._collective: GlooDPGroup | None = None
        self._lockstep: LockstepRank | None = None
        self._rendezvous: dict[str, Rendezvous] = {}  # by address: one per DP group this rank hosted
        preload(config)
        # A class handed over through Ray (e.g. defined in a notebook) wins over the path.
        factory = check_engine_class(engine_cls, config.engine) if engine_cls else load_engine_class(config.engine)
        self.executor: Executor | None = None
        try:
            with startup_deadline(config.startup_timeout_s, f"engine rank {rank} on node {node_id[:12]}"):
                self.executor = self._start_workers(factory, device_ids, executor_factory)
                context = EngineContext(
                    rank,
                    local_rank,
                    config.dp_size,
                    config.world_size_of(rank),
                    node_id,
                    device_ids,
                    self.executor,
                    scratch_dir=str(self.ipc_dir.path),
                )
                if self.executor is None:  # with workers, each worker sees only its own device
                    set_device_visibility(config.accelerator, device_ids)
                self.engine = factory(context, **config.engine_kwargs)
        except BaseException:
            self._close_workers()
            raise
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._gate = guard(self.ctx, curve)

    def _start_workers(
        self, factory: object, device_ids: tuple[str, ...], executor_factory: ExecutorFactory | None
    ) -> Executor | None:
        """The rank's device workers, if the engine class names a worker class."""
        worker_class = getattr(factory, WORKER_CLASS_ATTR, None)
        if worker_class is None:
            return None
        cfg = self.config
        if executor_factory is None:
            raise ConfigError(f"engine={cfg.engine!r} needs device workers, which this backend cannot start")
        spec = WorkerGroupSpec(
            cfg.name,
            self.rank,
            cfg.world_size_of(self.rank),  # a P/D cluster's prefill ranks may shard over another number
            worker_class,
            self.node_id,
            cfg.accelerator,
            device_ids,
            self.ipc_dir,
            self._curve,
            cfg.max_message_bytes,
            cfg.startup_timeout_s,
        )
        return executor_factory(spec, self.fail)

    def _close_workers(self) -> None:
        if self.executor is not None:
            self.executor.close()
        self.ipc_dir.remove()

    def fail(self, exc: BaseException) -> None:
        """From any thread: the rank cannot go on (a worker died); its loop raises ``exc``."""
        with self._lock:
            self._failure = exc
            if self._loop is not None:
                self._loop.fail(exc)
        self._ring()

    def dp_master(self, dp_size: int | None = None) -> str:
        """``ip:port`` of the gloo rendezvous this rank hosts (asked of rank 0), listening already.

        With ``dp_size`` (a scale change) it is a new rendezvous, for the new DP group.
        """
        with self._lock:
            if dp_size is None and self._rendezvous:
                return next(iter(self._rendezvous))
            rendezvous = Rendezvous(node_ip(), dp_size or self.config.dp_size)
            self._rendezvous[rendezvous.address] = rendezvous
            return rendezvous.address

    def _hosted_store(self, address: str) -> object | None:
        with self._lock:
            found = self._rendezvous.get(address)
            return found.store if found is not None else None

    def _join_group(self, regroup: Regroup) -> DPCollective:
        """Join a new DP group after a scale change (the loop left the old one already)."""
        with self._lock:  # the old groups' rendezvous served their purpose: stop listening
            for address in [a for a in self._rendezvous if a != regroup.dp_master]:
                self._rendezvous.pop(address).close()
        return GlooDPGroup(
            regroup.dp_master,
            self.rank,
            regroup.dp_size,
            timeout_s=self.config.handshake_timeout_s,
            store=self._hosted_store(regroup.dp_master),
        )

    def run(self, handshake_addresses: list[str]) -> None:
        """Handshake, then serve until Shutdown; raises what the engine raised."""
        opts = socket_options(self.config, self._curve)
        hung = False
        try:
            inputs, addresses = bind_inputs(self.ctx, opts, self.config.transport, self.ipc_dir)

            def make_ready(init: Init) -> Ready:
                # Join the DP group before READY, so launch() returns with it formed.
                if init.parallel.lockstep:
                    self._collective = GlooDPGroup(
                        init.parallel.dp_master,
                        self.rank,
                        init.parallel.dp_size,
                        store=self._hosted_store(init.parallel.dp_master),
                    )
                capacity = int(getattr(self.engine, "capacity", lambda: 0)())
                return Ready(capacity, self.config.config_hash(), addresses)

            init = engine_handshake(
                self.ctx,
                opts,
                pick_address(handshake_addresses, same_node=self.local),
                self.rank,
                local=self.local,
                make_ready=make_ready,
                timeout_s=self.config.handshake_timeout_s,
            )
            self._serve(init, inputs, opts)
        except BaseException as exc:
            hung = isinstance(exc, EngineHungError)
            if self.on_failure is not None:  # before the (slow) teardown, so the death is known at once
                self.on_failure(exc)
            raise
        finally:
            with self._lock:
                self._loop = None
            if hung:
                # The stuck loop thread still holds the engine, its workers and its sockets: closing
                # them from here could block too. The process ends (its backend kills it), and that
                # frees them; only the socket files are removed here.
                self.ipc_dir.remove()
            else:
                self._release()

    def _release(self) -> None:
        """Each step runs even if an earlier one raises; the engine's own error stays the cause."""
        steps: list[Callable[[], object]] = [self.engine.shutdown]
        if self.executor is not None:
            steps.append(self.executor.close)
        collective = self._lockstep.collective if self._lockstep is not None else self._collective
        if collective is not None:
            steps.append(collective.close)
        steps += [rendezvous.close for rendezvous in self._rendezvous.values()]
        if self._gate is not None:
            steps.append(self._gate.stop)
        steps += [lambda: self.ctx.destroy(linger=0), self.ipc_dir.remove]
        for step in steps:
            try:
                step()
            except Exception:
                logger.exception("rank %d: cleanup step failed", self.rank)

    def _serve(self, init: Init, inputs: list[zmq.Socket[bytes]], opts: SocketOptions) -> None:
        with ExitStack() as stack:
            collect = make_socket(self.ctx, zmq.PUSH, opts)
            stack.callback(collect.close, 0)
            collect.connect(init.addresses.coordinator_collect)
            broadcast = make_socket(self.ctx, zmq.SUB, opts)
            stack.callback(broadcast.close, 0)
            broadcast.connect(init.addresses.coordinator_broadcast)
            at = (init.addresses.coordinator_collect, init.addresses.coordinator_broadcast)
            sockets = EngineSockets(self.ctx, inputs, collect, broadcast, self.rank, at)
            stack.callback(sockets.close)
            stack.callback(self._forget_loop)  # first: nobody rings the sockets while they close
            loop = self._make_loop(init, sockets)
            with self._lock:
                if self._stopping.is_set():
                    return
                self._loop = loop
                if self._failure is not None:  # a worker died during the handshake
                    loop.fail(self._failure)
            run_watched(loop.run, loop.clock, self.config.step_timeout_s, self._hung, f"raydp-dp{self.rank}-loop")

    def _hung(self, seconds: float, where: str) -> EngineHungError:
        logger.error("rank %d made no progress for %.1fs; its loop thread is in:\n%s", self.rank, seconds, where)
        return EngineHungError(self.rank, self.node_id, seconds, where)

    def _make_loop(self, init: Init, sockets: EngineSockets) -> EngineLoop:
        parallel = init.parallel
        if parallel.lockstep:
            assert self._collective is not None, "the DP group is formed before READY"
            self._lockstep = LockstepRank(
                self.rank,
                EngineWaves(self.rank, parallel.allreduce_interval, wave=parallel.wave),
                self._collective,
                sockets.to_coordinator,
                join=self._join_group,
                attach=getattr(self.engine, "attach_dp_group", None),
                min_interval_s=self.config.allreduce_min_interval_s,
            )
        return EngineLoop(
            self.engine,
            self.rank,
            sockets,
            lockstep=self._lockstep,
            stats_interval_s=parallel.stats_interval_s,
            workers=self.executor,
        )

    def counters(self) -> dict[str, int]:
        """The loop's request counters (zeros before it runs); safe from any thread."""
        loop = self._loop
        return dict(loop.counters) if loop is not None else dict.fromkeys(COUNTERS, 0)

    def shutdown(self) -> None:
        """Stop the loop from another thread (wakes it if it is idle); never blocks."""
        self._stopping.set()
        with self._lock:
            if self._loop is None:
                return
            self._loop.stop()
        self._ring()

    def follow_coordinator(self, endpoints: CoordinatorEndpoints) -> bool:
        """The coordinator moved to another node (its old one died): reconnect to it. From any thread;
        False if the loop is not running (a rank joining later is told the new addresses in its INIT)."""
        with self._lock:
            if self._loop is None:
                return False
            self._loop.sockets.follow_coordinator(endpoints, self.node_id)
            return True

    def _ring(self) -> None:
        """Wake the loop if it waits for input."""
        with self._lock:
            if self._loop is not None:
                self._loop.sockets.ring()

    def _forget_loop(self) -> None:
        with self._lock:
            self._loop = None


def set_device_visibility(accelerator: str, device_ids: tuple[str, ...]) -> None:
    env = VISIBILITY_ENV.get(accelerator)
    if env is not None and device_ids:
        os.environ[env] = ",".join(device_ids)
