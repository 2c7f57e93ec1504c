"""Placement planning: inventory + DP layout -> one node (or node group) per rank.

Pure: no Ray. :func:`plan_placement` decides, for every DP rank, which node
hosts it, so that placement groups can be pinned there by node id.

Strategies (``dp_size_local`` is the number of ranks on the master node):

- ``fill``: the master hosts ``dp_size_local`` ranks (default: as many as fit),
  the other nodes as many as fit, most free first, then by node id;
- ``strict``: every node used hosts exactly the same number of ranks
  (``dp_size_local``; default the largest divisor of ``dp_size`` that the
  master can host and enough other nodes can match);
- ``span``: ``world_size`` exceeds a node's devices, so one rank covers ``k``
  identical (same device count), fully free nodes; groups use PACK.

Master ranks come first (``0..dp_size_local-1``). A node is never asked for more
than its *available* devices, nor (for the engine core) more CPUs than it has
free. Anything that cannot be placed raises :class:`PlacementError` describing
the request, every node's capacity and the nearest setting that would fit; bad
arguments raise :class:`ConfigError`.
"""

from __future__ import annotations

from collections.abc import Iterable

from raydp.config import PLACEMENT_STRATEGIES, PlacementStrategy
from raydp.errors import ConfigError, PlacementError
from raydp.placement._explain import infeasible_message
from raydp.placement._layouts import Ctx, InfeasibleError, Request, build_plan, find_layout, ranks_fit, span_usable
from raydp.placement.inventory import Inventory
from raydp.placement.plan import CPU, BundleStrategy, PlacementPlan, RankPlacement, rank_bundles

__all__ = [
    "CPU",
    "BundleStrategy",
    "PlacementPlan",
    "PlacementStrategy",
    "RankPlacement",
    "plan_placement",
    "rank_bundles",
    "ranks_fit",
    "span_usable",
]


def plan_placement(
    inventory: Inventory,
    *,
    dp_size: int,
    world_size: int,
    dp_size_local: int | None = None,
    strategy: str = "fill",
    master_node_id: str | None = None,
    node_allowlist: Iterable[str] | None = None,
) -> PlacementPlan:
    """Place ``dp_size`` ranks of ``world_size`` devices each on ``inventory``.

    ``master_node_id`` (a node id or a unique prefix of >= 4 characters) is the
    driver's node; ``None`` means the head node. ``node_allowlist`` restricts
    which nodes may host ranks (ids or unique prefixes).
    """
    req = _validate(
        inventory,
        dp_size=dp_size,
        world_size=world_size,
        dp_size_local=dp_size_local,
        strategy=strategy,
        master_node_id=master_node_id,
        node_allowlist=node_allowlist,
    )
    try:
        layout = find_layout(Ctx(inventory, req))
    except InfeasibleError as exc:
        raise PlacementError(infeasible_message(inventory, req, str(exc))) from None
    return build_plan(inventory, req, layout)


# ---------------------------------------------------------------- validation


def _validate(
    inv: Inventory,
    *,
    dp_size: int,
    world_size: int,
    dp_size_local: int | None,
    strategy: str,
    master_node_id: str | None,
    node_allowlist: Iterable[str] | None,
) -> Request:
    _check_int("dp_size", dp_size, 1)
    _check_int("world_size", world_size, 1)
    strat = _as_strategy(strategy)
    if dp_size_local is not None:
        _check_int("dp_size_local", dp_size_local, 0)
        if dp_size_local > dp_size:
            raise ConfigError(f"dp_size_local={dp_size_local} must be <= dp_size={dp_size}")
    _check_strategy_args(strat, dp_size, dp_size_local, inv.accelerator)
    master = _resolve_master(inv, master_node_id)
    if master is None and dp_size_local:
        raise ConfigError(
            f"dp_size_local={dp_size_local} needs a master node: pass master_node_id (the inventory has no head node)"
        )
    allowed = _resolve_allowlist(inv, node_allowlist)
    return Request(dp_size, world_size, dp_size_local, strat, master, allowed)


def _as_strategy(value: str) -> PlacementStrategy:
    for s in PLACEMENT_STRATEGIES:
        if s == value:
            return s
    raise ConfigError(f"strategy={value!r}: expected one of {', '.join(PLACEMENT_STRATEGIES)}")


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r}: expected an integer >= {minimum}")


def _check_strategy_args(strategy: PlacementStrategy, dp_size: int, local: int | None, accelerator: str) -> None:
    if strategy == "strict" and local is not None:
        if local == 0:
            raise ConfigError(
                "dp_size_local=0 with strategy='strict': every node used hosts "
                "dp_size_local ranks, so it must be >= 1 (or unset)"
            )
        if dp_size % local:
            raise ConfigError(f"dp_size_local={local} with strategy='strict' must divide dp_size={dp_size}")
    if strategy == "span":
        if local is not None and local > 1:
            raise ConfigError(
                f"dp_size_local={local} with strategy='span': a spanning rank uses whole "
                "nodes, so the master hosts at most 1 rank (use 0, 1 or unset)"
            )
        if accelerator == CPU:
            raise ConfigError(
                "strategy='span' with accelerator='CPU': the engine core needs a CPU on a "
                "node whose CPUs are all devices; use 'fill' or 'strict'"
            )


def _resolve_master(inv: Inventory, master_node_id: str | None) -> str | None:
    if master_node_id is not None:
        return inv.resolve(master_node_id, "master_node_id")
    head = inv.head
    return None if head is None else head.node_id


def _resolve_allowlist(inv: Inventory, allowlist: Iterable[str] | None) -> frozenset[str] | None:
    if allowlist is None:
        return None
    if isinstance(allowlist, str):
        allowlist = [allowlist]
    values = list(allowlist)
    if not values:
        raise ConfigError("node_allowlist=(): empty; leave it unset to allow every node")
    return frozenset(inv.resolve(v, "node_allowlist") for v in values)
