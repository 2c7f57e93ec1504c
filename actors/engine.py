"""``EngineCoreActor``: one DP rank, hosting a user engine core in a Ray actor.

Protocol (Ray methods; requests and outputs travel over ZMQ):

* construction builds the user's engine core (its exception, with traceback,
  is the actor's death cause, so ``launch()`` can show it);
* ``wait_for_init()`` -> ``{rank, node_id, pid}`` once constructed;
* ``dp_master()`` -> ``"ip:port"`` for the gloo rendezvous (asked of rank 0);
* ``run(handshake_addresses)`` does the handshake, then runs the engine
  loop until Shutdown; returns normally only after a clean shutdown, and
  raises the engine's exception if a step fails;
* ``shutdown()`` wakes and stops the loop from another thread.

States: constructed -> handshaking -> running -> stopped.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import ray
import zmq

from raydp.collective import GlooDPGroup, free_port
from raydp.config import RaydpConfig
from raydp.engine import EngineContext, load_engine_class
from raydp.engine_loop import EngineLoop, EngineSockets
from raydp.handshake import engine_handshake
from raydp.logs import configure_component_logging
from raydp.protocol import Init, Ready
from raydp.transport import IpcDir, SocketOptions, bind_endpoints, make_socket, node_ip, pick_address
from raydp.waves import EngineWaves

# Environment variables that restrict a process to some devices, per Ray resource.
VISIBILITY_ENV = {
    "GPU": "CUDA_VISIBLE_DEVICES",
    "TPU": "TPU_VISIBLE_CHIPS",
    "neuron_cores": "NEURON_RT_VISIBLE_CORES",
}


def socket_options(config: RaydpConfig) -> SocketOptions:
    return SocketOptions(high_water_mark=config.high_water_mark, max_message_bytes=config.max_message_bytes)


class EngineCoreActor:
    def __init__(
        self,
        config: RaydpConfig,
        rank: int,
        local_rank: int,
        frontend_node_id: str,
        device_ids: tuple[str, ...] = (),
    ) -> None:
        self.config, self.rank = config, rank
        self.node_id = ray.get_runtime_context().get_node_id()
        self.local = self.node_id == frontend_node_id
        tag = f"{config.name} dp{rank} lr{local_rank} node {self.node_id[:8]}"
        configure_component_logging(tag)
        set_process_title(f"raydp::{tag}")
        _set_device_visibility(config.accelerator, device_ids)
        context = EngineContext(rank, local_rank, config.dp_size, config.world_size, self.node_id, device_ids)
        self.engine = load_engine_class(config.engine)(context, **config.engine_kwargs)
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.ipc_dir = IpcDir(f"{config.name}-dp{rank}")
        self._wake_address = f"inproc://raydp-engine-wake-{rank}"
        self._loop: EngineLoop | None = None
        self._stopping = threading.Event()

    def wait_for_init(self) -> dict[str, Any]:
        return {"rank": self.rank, "node_id": self.node_id, "pid": os.getpid()}

    def dp_master(self) -> str:
        ip = node_ip()
        return f"{ip}:{free_port(ip)}"

    def run(self, handshake_addresses: list[str], frontend_node_id: str) -> None:
        opts = socket_options(self.config)
        input_sock = make_socket(self.ctx, zmq.ROUTER, opts)
        addresses = bind_endpoints(
            input_sock, "input", transport=self.config.transport, ipc_dir=self.ipc_dir
        )

        def make_ready(_: Init) -> Ready:
            capacity = int(getattr(self.engine, "capacity", lambda: 0)())
            return Ready(capacity, self.config.config_hash(), addresses)

        init = engine_handshake(
            self.ctx,
            opts,
            pick_address(handshake_addresses, same_node=self.node_id == frontend_node_id),
            self.rank,
            local=self.local,
            make_ready=make_ready,
            timeout_s=self.config.handshake_timeout_s,
        )
        self._serve(init, input_sock, opts)

    def _serve(self, init: Init, input_sock: zmq.Socket[bytes], opts: SocketOptions) -> None:
        coord = init.addresses
        collect = make_socket(self.ctx, zmq.PUSH, opts)
        collect.connect(coord.coordinator_collect)
        broadcast = make_socket(self.ctx, zmq.SUB, opts)
        broadcast.connect(coord.coordinator_broadcast)
        sockets = EngineSockets(self.ctx, input_sock, collect, broadcast, self._wake_address, self.rank)
        waves = collective = None
        if init.parallel.lockstep:
            collective = GlooDPGroup(init.parallel.dp_master, self.rank, init.parallel.dp_size)
            waves = EngineWaves(self.rank, init.parallel.allreduce_interval)
            attach = getattr(self.engine, "attach_dp_group", None)
            if attach is not None:
                attach(collective.group)
        self._loop = EngineLoop(
            self.engine, self.rank, sockets, waves=waves, collective=collective,
            stats_interval_s=init.parallel.stats_interval_s,
        )
        try:
            if not self._stopping.is_set():
                self._loop.run()
        finally:
            sockets.close()
            if collective is not None:
                collective.close()
            self.engine.shutdown()
            self.ipc_dir.remove()

    def shutdown(self) -> None:
        self._stopping.set()
        if self._loop is None:
            return
        self._loop.stop()
        bell = self.ctx.socket(zmq.PAIR)
        bell.connect(self._wake_address)
        bell.send(b"")
        bell.close(linger=100)


def _set_device_visibility(accelerator: str, device_ids: tuple[str, ...]) -> None:
    env = VISIBILITY_ENV.get(accelerator)
    if env is not None and device_ids:
        os.environ[env] = ",".join(device_ids)


def set_process_title(title: str) -> None:
    """Show ``title`` in ps/top (Ray ships setproctitle in its raylet module)."""
    try:
        from ray._raylet import setproctitle

        setproctitle(title)
    except (ImportError, AttributeError):  # pragma: no cover - depends on the Ray build
        pass


@ray.remote(num_cpus=0)
def probe_device_ids(accelerator: str) -> list[str]:
    """Run inside one device bundle: which device ids did Ray assign there?"""
    ids = ray.get_runtime_context().get_accelerator_ids().get(accelerator, [])
    return [str(i) for i in ids]
