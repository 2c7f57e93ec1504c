"""The DP process group lockstep ranks all-reduce over (torch.distributed, gloo).

Kept apart from the engine loop so that the loop's logic can run with any
object offering ``any_unfinished`` (the unit tests use an in-process one).
"""

from __future__ import annotations

import datetime
import socket
from typing import Any, Protocol


class DPCollective(Protocol):
    group: Any

    def any_unfinished(self, local: bool) -> bool: ...

    def close(self) -> None: ...


class GlooDPGroup:
    """A gloo process group of ``dp_size`` ranks rendezvousing at ``master``."""

    def __init__(self, master: str, rank: int, dp_size: int, timeout_s: float = 300.0) -> None:
        import torch.distributed as dist

        self._dist = dist
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{master}",
            rank=rank,
            world_size=dp_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        self.group = dist.group.WORLD

    def any_unfinished(self, local: bool) -> bool:
        import torch

        flag = torch.tensor([1 if local else 0], dtype=torch.int32)
        self._dist.all_reduce(flag, op=self._dist.ReduceOp.MAX, group=self.group)
        return bool(flag.item())

    def close(self) -> None:
        if self._dist.is_initialized():
            self._dist.destroy_process_group()


def free_port(ip: str) -> int:
    """A TCP port that was free on ``ip`` a moment ago (for the gloo rendezvous)."""
    with socket.socket() as sock:
        sock.bind((ip, 0))
        port: int = sock.getsockname()[1]
        return port
