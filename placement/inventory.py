"""The cluster's accelerator inventory: alive nodes and their free devices.

:func:`inventory_from_nodes` is pure: it turns ``ray.nodes()``-shaped dicts (and
optionally per-node *available* resources) into an :class:`Inventory` the
planner can work on. :func:`raydp.placement.live.read_inventory` is the thin Ray wrapper that fills it.

Nodes are identified by their Ray node id, never by IP: on one-host test
clusters, Kubernetes host networking and some clouds several Ray nodes share
an IP.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from raydp.errors import ConfigError

HEAD_RESOURCE = "node:__internal_head__"
MIN_PREFIX_LEN = 4
SHORT_ID_LEN = 8
# Float resource arithmetic in Ray can leave 3.9999999 where 4 was meant.
_EPS = 1e-6


@dataclass(frozen=True)
class NodeInfo:
    """One alive node, seen through one resource name (the accelerator).

    ``total`` and ``available`` count that resource. ``cpus_available`` is the
    node's free CPU count (the engine core of each rank needs one); ``None``
    means unknown, which the planner treats as "not a limit".
    """

    node_id: str
    ip: str
    labels: Mapping[str, str] = field(default_factory=dict, hash=False)
    is_head: bool = False
    total: float = 0.0
    available: float = 0.0
    cpus_available: float | None = None

    def __post_init__(self) -> None:
        # A private copy, so a caller mutating its dict cannot change a frozen node.
        object.__setattr__(self, "labels", dict(self.labels))

    @property
    def free(self) -> int:
        """Whole free devices (Ray may report fractions after fractional use)."""
        return whole(self.available)

    @property
    def devices(self) -> int:
        """Whole devices the node has in total."""
        return whole(self.total)

    @property
    def free_cpus(self) -> int | None:
        return None if self.cpus_available is None else whole(self.cpus_available)


@dataclass(frozen=True)
class Inventory:
    """The alive nodes (in a stable order) and the accelerator they were read for."""

    nodes: tuple[NodeInfo, ...]
    accelerator: str = "GPU"

    def __post_init__(self) -> None:
        ids = [n.node_id for n in self.nodes]
        if len(set(ids)) != len(ids):
            raise ConfigError(f"inventory has duplicate node ids: {sorted(ids)}")

    @property
    def head(self) -> NodeInfo | None:
        return next((n for n in self.nodes if n.is_head), None)

    @cached_property
    def _by_id(self) -> dict[str, NodeInfo]:
        return {n.node_id: n for n in self.nodes}

    @cached_property
    def _short_ids(self) -> dict[str, str]:
        return short_ids(n.node_id for n in self.nodes)

    def node(self, node_id: str) -> NodeInfo:
        """The node with exactly this id; ConfigError (never KeyError) if there is none."""
        try:
            return self._by_id[node_id]
        except KeyError:
            known = ", ".join(self._short_ids.values()) or "(none)"
            raise ConfigError(f"unknown node id {node_id!r}; known nodes: {known}") from None

    def short_ids(self) -> dict[str, str]:
        """node id -> shortest unique prefix of at least 8 characters."""
        return dict(self._short_ids)

    def short(self, node_id: str) -> str:
        """The short form of one node id (the id itself if it is not in the inventory)."""
        return self._short_ids.get(node_id, node_id[:SHORT_ID_LEN])

    def resolve(self, value: str, field_name: str = "node") -> str:
        """The full node id that ``value`` (a full id or unique prefix) names."""
        return resolve_node_id([n.node_id for n in self.nodes], value, field_name)


def whole(x: float) -> int:
    """Round a Ray resource amount down to whole units, tolerating float noise."""
    if not math.isfinite(x) or x <= 0:
        return 0
    return math.floor(x + _EPS)


def short_ids(node_ids: Iterable[str]) -> dict[str, str]:
    """Map each id to its shortest prefix of >= 8 chars that no other id shares."""
    ids = sorted(set(node_ids))
    out: dict[str, str] = {}
    # In sorted order an id shares its longest common prefix with a neighbour.
    for i, nid in enumerate(ids):
        shared = max(
            (_common_prefix(nid, ids[j]) for j in (i - 1, i + 1) if 0 <= j < len(ids)),
            default=0,
        )
        out[nid] = nid[: max(SHORT_ID_LEN, shared + 1)]
    return out


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def resolve_node_id(node_ids: Iterable[str], value: str, field_name: str = "node") -> str:
    """Resolve an exact node id or a unique prefix of >= 4 characters.

    Raises ConfigError naming ``field_name``, the value, and the known node ids.
    """
    ids = list(node_ids)
    if value in ids:
        return value
    known = ", ".join(short_ids(ids).values()) or "(none)"
    if len(value) < MIN_PREFIX_LEN:
        raise ConfigError(
            f"{field_name}={value!r}: not a node id; a prefix needs >= {MIN_PREFIX_LEN} characters "
            f"(known nodes: {known})"
        )
    matches = [i for i in ids if i.startswith(value)]
    if len(matches) == 1:
        return matches[0]
    what = "matches no alive node" if not matches else f"is ambiguous ({len(matches)} nodes match)"
    raise ConfigError(f"{field_name}={value!r} {what} (known nodes: {known})")


def inventory_from_nodes(
    nodes: Iterable[Mapping[str, Any]],
    available: Mapping[str, Mapping[str, float]] | None,
    accelerator: str,
) -> Inventory:
    """Build an :class:`Inventory` from ``ray.nodes()``-shaped dicts.

    ``available`` maps node id -> that node's free resources. When it is
    ``None`` every node is assumed idle (available = total). A node missing from
    it, or a resource missing from a node's entry, counts as 0 free: Ray drops
    resources whose free amount reached zero, and over-counting would
    over-commit the node.
    """
    if not accelerator:
        raise ConfigError("accelerator='': expected a Ray resource name such as 'GPU'")
    parsed = [_node_info(raw, available, accelerator) for raw in nodes if _is_alive(raw)]
    # Head first, then by node id: a stable order that does not depend on how
    # Ray happened to list the nodes.
    parsed.sort(key=lambda n: (not n.is_head, n.node_id))
    return Inventory(nodes=tuple(parsed), accelerator=accelerator)


def _is_alive(raw: Mapping[str, Any]) -> bool:
    return bool(raw.get("Alive", raw.get("alive", False)))


def _node_info(
    raw: Mapping[str, Any],
    available: Mapping[str, Mapping[str, float]] | None,
    accelerator: str,
) -> NodeInfo:
    node_id = str(raw.get("NodeID") or "")
    if not node_id:
        raise ConfigError(f"node entry without a NodeID: {dict(raw)!r:.200}")
    resources: Mapping[str, float] = raw.get("Resources") or {}
    free: Mapping[str, float] = resources if available is None else available.get(node_id, {})
    labels = raw.get("Labels") or {}
    return NodeInfo(
        node_id=node_id,
        ip=str(raw.get("NodeManagerAddress") or ""),
        labels={str(k): str(v) for k, v in labels.items()},
        is_head=HEAD_RESOURCE in resources,
        total=float(resources.get(accelerator, 0.0)),
        available=float(free.get(accelerator, 0.0)),
        cpus_available=float(free.get("CPU", 0.0)),
    )
