"""The plan types the planner returns, kept apart from how plans are made.

:mod:`raydp.placement.groups`, :mod:`raydp.placement.report` and the actor manager read
these types; keeping them out of the layout search and its error messages keeps
the contract those callers rely on small and easy to find.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from raydp.config import PlacementStrategy

BundleStrategy = Literal["STRICT_PACK", "PACK"]
CPU = "CPU"


@dataclass(frozen=True)
class RankPlacement:
    """Where one DP rank runs.

    ``node_id`` is the node hosting the engine core (and, unless the rank
    spans, all its devices); ``node_ids`` lists every node the rank uses, the
    engine core's node first. ``is_master`` is true for ranks on the master node.
    """

    rank: int
    node_id: str
    node_ip: str
    local_rank: int
    is_master: bool
    node_ids: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.node_ids:
            object.__setattr__(self, "node_ids", (self.node_id,))

    @property
    def spans(self) -> bool:
        return len(self.node_ids) > 1


@dataclass(frozen=True)
class PlacementPlan:
    """One :class:`RankPlacement` per DP rank, in rank order."""

    ranks: tuple[RankPlacement, ...]
    strategy: PlacementStrategy
    bundle_strategy: BundleStrategy
    world_size: int
    accelerator: str
    master_node_id: str | None = None
    dp_size_local: int = 0

    @property
    def dp_size(self) -> int:
        return len(self.ranks)

    def node_ids(self) -> tuple[str, ...]:
        """Every node the plan uses, in first-use order."""
        return tuple(dict.fromkeys(n for r in self.ranks for n in r.node_ids))

    def bundles(self) -> list[dict[str, float]]:
        """The bundles of one rank's placement group (devices, then the engine core CPU)."""
        return rank_bundles(self.world_size, self.accelerator)

    def bundle_node_ids(self, rank: int) -> tuple[str, ...]:
        """The node each bundle of ``rank``'s group must land on (``world_size + 1`` entries)."""
        r = self.ranks[rank]
        per_node = self.world_size // len(r.node_ids)
        devices = tuple(r.node_ids[i // per_node] for i in range(self.world_size))
        return (*devices, r.node_id)


def rank_bundles(world_size: int, accelerator: str) -> list[dict[str, float]]:
    """``world_size`` device bundles then one CPU bundle for the engine core."""
    return [{accelerator: 1.0} for _ in range(world_size)] + [{CPU: 1.0}]
