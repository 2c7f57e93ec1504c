"""LoRA adapters across N API servers running vLLM's front-end over one raydp cluster.

vLLM's front-end numbers adapters per process (``lora_int_id``, from 1 in the
order it meets them) and its engines key their adapter cache by that number.
With several API server processes the numbers of one server mean other
adapters on another: a rank would run adapter 2 of one server's numbering for
a request that meant another's. So every adapter crossing to the ranks is
renumbered by what it is, its name and path (:func:`cluster_lora_id`), and
numbers coming back are turned into the server's own (:class:`LoraIds`).

An adapter loaded at run time (``/v1/load_lora_adapter``) reaches every rank,
but only the server that loaded it knows its name. The ranks report the
adapters they were given, with their paths; the other servers find a name they
do not know there (:class:`ClusterLoraResolver`, one of vLLM's LoRA resolvers,
asked when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is set, as loading at run time
requires anyway).

A rank that restarts comes back holding no adapter. The first API server
loads again the adapters it held when it died (:class:`AdapterReloads`), so
that its first requests for them find them, and its report names them again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import msgspec

from raydp.wire.control import StatsSnapshot

try:  # vLLM is an optional dependency: this module is imported only where it is installed
    from vllm.lora.request import LoRARequest
    from vllm.lora.resolver import LoRAResolver
except ImportError:  # pragma: no cover
    LoRARequest = LoRAResolver = object  # type: ignore[assignment,misc]

ID_SPACE = 2**31 - 1  # lora_int_id is a positive int32 in vLLM's worker tables


def cluster_lora_id(name: str, path: str) -> int:
    """The number every process gives the adapter ``name`` at ``path`` (positive; 1 in 2^31 per pair collides)."""
    digest = hashlib.blake2b(f"{name}\0{path}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % ID_SPACE + 1


class LoraIds:
    """This server's numbers for adapters, and the cluster's."""

    def __init__(self) -> None:
        self._to_cluster: dict[int, int] = {}
        self._to_local: dict[int, int] = {}

    def outgoing(self, lora_request: Any) -> Any:
        """``lora_request`` as the ranks must see it: numbered by name and path (a copy; None stays None)."""
        if lora_request is None:
            return None
        cluster = cluster_lora_id(str(lora_request.lora_name), str(lora_request.lora_path))
        local = int(lora_request.lora_int_id)
        self._to_cluster[local], self._to_local[cluster] = cluster, local
        return msgspec.structs.replace(lora_request, lora_int_id=cluster)

    def cluster_id(self, local: int) -> int:
        return self._to_cluster.get(local, local)

    def local_ids(self, cluster: set[int]) -> set[int]:
        return {self._to_local[i] for i in cluster if i in self._to_local}


class ClusterLoraResolver(LoRAResolver):  # type: ignore[misc]
    """Finds an adapter another API server loaded, by the paths the ranks report (``paths``: name -> path)."""

    def __init__(self, paths: Callable[[], dict[str, str]]) -> None:
        self._paths = paths

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> Any:
        path = self._paths().get(lora_name)
        # The number is the front-end's to give (it renumbers what a resolver finds); 1 is a placeholder.
        return None if path is None else LoRARequest(lora_name=lora_name, lora_int_id=1, lora_path=path)


class AdapterReloads:
    """Which adapters a rank held before it died, to load again once it is back (from the snapshots)."""

    def __init__(self) -> None:
        self._held: dict[int, list[str]] = {}
        self._dead: set[int] = set()
        self._paths: dict[str, str] = {}

    def due(self, snap: StatsSnapshot) -> list[tuple[int, list[Any]]]:
        """``(rank, [LoRARequest])`` for each rank that came back since the last snapshot seen."""
        out = []
        self._paths.update(snap.adapter_paths)
        for rank in range(len(snap.counts)):
            state = snap.adapters[rank] if rank < len(snap.adapters) else None
            if rank in snap.dead:
                self._dead.add(rank)
                continue
            if rank in self._dead:
                self._dead.discard(rank)
                held = [n for n in self._held.get(rank, []) if n in self._paths]
                out.append((rank, [LoRARequest(n, cluster_lora_id(n, self._paths[n]), self._paths[n]) for n in held]))
            if state is not None and state.resident:
                self._held[rank] = list(state.resident)
        return [(rank, requests) for rank, requests in out if requests]


__all__ = ["AdapterReloads", "ClusterLoraResolver", "LoraIds", "cluster_lora_id"]
