"""The DP process group lockstep ranks all-reduce over (torch.distributed, gloo).

Kept apart from the engine loop so that the loop's logic can run with any
object offering ``sync`` (the unit tests use an in-process one).
"""

from __future__ import annotations

import datetime
import socket
from typing import Any, Protocol

from raydp.engine.gloo_interface import use_interface_of
from raydp.wire.transport import node_ip


class DPCollective(Protocol):
    group: Any
    master: str
    last_pace: int  # the MAX of the paces the last collected all-reduce carried

    def sync(self, unfinished: bool, hold: bool) -> tuple[bool, bool]:
        """All-reduce (MAX) this rank's two flags: does anyone have unfinished work, is anyone held."""
        ...

    def start(self, unfinished: bool, hold: bool, pace: int = 0) -> None:
        """The same all-reduce, without waiting for it (one at a time), also of ``pace`` (MAX)."""
        ...

    def arrived(self) -> bool:
        """Whether the all-reduce :meth:`start` began has completed (never blocks)."""
        ...

    def collect(self) -> tuple[bool, bool]:
        """Wait for the all-reduce :meth:`start` began and return its result."""
        ...

    def close(self) -> None: ...


class Rendezvous:
    """The TCP store the ranks of a group meet at, listening from construction on.

    The listening socket is bound here, on ``ip`` only, and handed to the
    store: choosing a "free" port and letting the store bind it later races
    with every outgoing connection on the host (the kernel hands the same
    ephemeral ports to ``connect()``), and the store on its own would listen
    on every interface.
    """

    def __init__(self, ip: str, dp_size: int, timeout_s: float = 300.0) -> None:
        import torch.distributed as dist

        listener = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET)
        try:
            listener.bind((ip, 0))
            listener.listen(128)
            port = listener.getsockname()[1]
            self.store: Any = dist.TCPStore(
                ip,
                port,
                dp_size,
                is_master=True,
                timeout=datetime.timedelta(seconds=timeout_s),
                wait_for_workers=False,
                master_listen_fd=listener.fileno(),
            )
        except BaseException:
            listener.close()
            raise
        listener.detach()  # the store owns the descriptor now, and closes it
        self.address = f"{ip}:{port}"

    def close(self) -> None:
        # The server stops when its last reference goes.
        self.store = None


class GlooDPGroup:
    """A gloo process group of ``dp_size`` ranks meeting at ``master``.

    The rank that hosts the :class:`Rendezvous` passes its store; the others
    connect to it as clients.
    """

    def __init__(self, master: str, rank: int, dp_size: int, timeout_s: float = 300.0, store: Any = None) -> None:
        import torch.distributed as dist

        self._dist = dist
        timeout = datetime.timedelta(seconds=timeout_s)
        if store is None:
            host, _, port = master.rpartition(":")
            store = dist.TCPStore(host, int(port), dp_size, is_master=False, timeout=timeout)
        use_interface_of(node_ip())  # else gloo may bind where the hostname resolves: loopback, often
        # An engine may have made the process's default group its own (vLLM makes a world-size-1
        # group for its workers): the DP group then stands alone, as vLLM's own DP groups do.
        self._owns_default = not dist.is_initialized()
        if self._owns_default:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=dp_size, timeout=timeout)
            self.group: Any = dist.group.WORLD
        else:
            self.group = dist.ProcessGroupGloo(store, rank, dp_size, timeout)
        self.master, self.dp_size = master, dp_size
        import torch

        self._flags = torch.zeros(2, dtype=torch.int32)  # reused by every blocking all-reduce
        self._async_flags = torch.zeros(3, dtype=torch.int32)  # the one in flight owns its own tensor
        # Read and written through NumPy views of the same memory: a tensor's
        # __setitem__ costs ~2 us, a view's ~40 ns, and a rank pays it every interval.
        self._flags_view, self._async_view = self._flags.numpy(), self._async_flags.numpy()
        self._work: Any = None
        self.last_pace = 0

    def sync(self, unfinished: bool, hold: bool) -> tuple[bool, bool]:
        self._flags_view[:] = (unfinished, hold)
        self._dist.all_reduce(self._flags, op=self._dist.ReduceOp.MAX, group=self.group)
        unfinished_all, hold_any = self._flags_view.tolist()
        return bool(unfinished_all), bool(hold_any)

    def start(self, unfinished: bool, hold: bool, pace: int = 0) -> None:
        assert self._work is None, "one non-blocking all-reduce at a time"
        self._async_view[:] = (unfinished, hold, pace)
        self._work = self._dist.all_reduce(
            self._async_flags, op=self._dist.ReduceOp.MAX, group=self.group, async_op=True
        )

    def arrived(self) -> bool:
        return self._work is not None and bool(self._work.is_completed())

    def collect(self) -> tuple[bool, bool]:
        assert self._work is not None, "collect() without start()"
        work, self._work = self._work, None
        work.wait()
        unfinished, hold, self.last_pace = self._async_view.tolist()
        return bool(unfinished), bool(hold)

    def close(self) -> None:
        if not self._owns_default:
            self.group = None  # a standalone group ends with its last reference; the default is the engine's
        elif self._dist.is_initialized():
            self._dist.destroy_process_group()
