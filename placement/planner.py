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

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Literal

from placement.inventory import Inventory, NodeInfo
from placement.report import render_table
from raydp.errors import ConfigError, PlacementError

Strategy = Literal["strict", "fill", "span"]
BundleStrategy = Literal["STRICT_PACK", "PACK"]
STRATEGIES: tuple[Strategy, ...] = ("fill", "strict", "span")
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
    strategy: Strategy
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


def ranks_fit(node: NodeInfo, accelerator: str, world_size: int) -> int:
    """How many single-node ranks of ``world_size`` devices fit on ``node`` now."""
    if accelerator == CPU:
        # Device bundles and the engine core draw on the same CPUs.
        return node.free // (world_size + 1)
    by_devices = node.free // world_size
    cpus = node.free_cpus
    return by_devices if cpus is None else min(by_devices, cpus)


@dataclass(frozen=True)
class _Request:
    dp_size: int
    world_size: int
    dp_size_local: int | None
    strategy: Strategy
    master: str | None
    allowed: frozenset[str] | None


class _InfeasibleError(Exception):
    """Internal: the request does not fit; the message says why (one clause)."""


@dataclass
class _Ctx:
    """A request seen against an inventory: the nodes it may use and their fits."""

    inv: Inventory
    req: _Request
    candidates: list[NodeInfo] = field(default_factory=list)
    fits: dict[str, int] = field(default_factory=dict)
    _others: list[NodeInfo] | None = None

    def __post_init__(self) -> None:
        allowed = self.req.allowed
        self.candidates = [n for n in self.inv.nodes if allowed is None or n.node_id in allowed]
        acc, ws = self.inv.accelerator, self.req.world_size
        self.fits = {n.node_id: ranks_fit(n, acc, ws) for n in self.candidates}

    @property
    def master(self) -> NodeInfo | None:
        """The master node if it may host ranks (it may be excluded by the allowlist)."""
        return next((n for n in self.candidates if n.node_id == self.req.master), None)

    def others(self) -> list[NodeInfo]:
        """Non-master candidates, most ranks fitting first, then by node id."""
        if self._others is None:
            rest = [n for n in self.candidates if n.node_id != self.req.master]
            self._others = sorted(rest, key=lambda n: (-self.fits[n.node_id], n.node_id))
        return self._others

    def master_fit(self) -> int:
        m = self.master
        return 0 if m is None else self.fits[m.node_id]

    def short(self, node_id: str) -> str:
        return self.inv.short(node_id)


# A layout is, per rank in order, the nodes it uses (engine core's node first).
_Layout = list[tuple[str, ...]]


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
        inventory, dp_size=dp_size, world_size=world_size, dp_size_local=dp_size_local,
        strategy=strategy, master_node_id=master_node_id, node_allowlist=node_allowlist,
    )
    try:
        layout = _layout(_Ctx(inventory, req))
    except _InfeasibleError as exc:
        raise PlacementError(_infeasible_message(inventory, req, str(exc))) from None
    return _build_plan(inventory, req, layout)


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
) -> _Request:
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
            f"dp_size_local={dp_size_local} needs a master node: pass master_node_id "
            "(the inventory has no head node)"
        )
    allowed = _resolve_allowlist(inv, node_allowlist)
    return _Request(dp_size, world_size, dp_size_local, strat, master, allowed)


def _as_strategy(value: str) -> Strategy:
    for s in STRATEGIES:
        if s == value:
            return s
    raise ConfigError(f"strategy={value!r}: expected one of {', '.join(STRATEGIES)}")


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name}={value!r}: expected an integer >= {minimum}")


def _check_strategy_args(strategy: Strategy, dp_size: int, local: int | None, accelerator: str) -> None:
    if strategy == "strict" and local is not None:
        if local == 0:
            raise ConfigError("dp_size_local=0 with strategy='strict': every node used hosts "
                              "dp_size_local ranks, so it must be >= 1 (or unset)")
        if dp_size % local:
            raise ConfigError(f"dp_size_local={local} with strategy='strict' must divide dp_size={dp_size}")
    if strategy == "span":
        if local is not None and local > 1:
            raise ConfigError(f"dp_size_local={local} with strategy='span': a spanning rank uses whole "
                              "nodes, so the master hosts at most 1 rank (use 0, 1 or unset)")
        if accelerator == CPU:
            raise ConfigError("strategy='span' with accelerator='CPU': the engine core needs a CPU on a "
                              "node whose CPUs are all devices; use 'fill' or 'strict'")


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


# ---------------------------------------------------------------- layouts


def _layout(ctx: _Ctx) -> _Layout:
    if ctx.req.strategy == "fill":
        return _fill(ctx)
    if ctx.req.strategy == "strict":
        return _strict(ctx)
    return _span(ctx)


def _master_clause(ctx: _Ctx) -> str:
    m = ctx.req.master
    if m is None:
        return "there is no master node"
    if ctx.master is None:
        return f"master node {ctx.short(m)} is not in the node allowlist"
    return f"master node {ctx.short(m)} fits {ctx.master_fit()}"


def _fill(ctx: _Ctx) -> _Layout:
    req = ctx.req
    local = min(ctx.master_fit(), req.dp_size) if req.dp_size_local is None else req.dp_size_local
    if local > ctx.master_fit():
        raise _InfeasibleError(f"dp_size_local={local} but {_master_clause(ctx)}")
    layout: _Layout = [(req.master,)] * local if req.master is not None else []
    for node in ctx.others():
        take = min(ctx.fits[node.node_id], req.dp_size - len(layout))
        layout += [(node.node_id,)] * take
    if len(layout) < req.dp_size:
        raise _InfeasibleError(f"only {len(layout)} of {req.dp_size} ranks fit")
    return layout


def _strict(ctx: _Ctx) -> _Layout:
    req = ctx.req
    mfit = ctx.master_fit()
    if req.dp_size_local is not None:
        per_node = req.dp_size_local
        if per_node > mfit:
            raise _InfeasibleError(f"dp_size_local={per_node} but {_master_clause(ctx)}")
        return _strict_layout(ctx, per_node, use_master=True)
    use_master = mfit >= 1
    cap = min(mfit, req.dp_size) if use_master else req.dp_size
    for per_node in _divisors_desc(req.dp_size, cap):
        try:
            return _strict_layout(ctx, per_node, use_master)
        except _InfeasibleError:
            continue
    where = f"at most the master's {mfit}" if use_master else "the master hosts none"
    raise _InfeasibleError(f"no per-node rank count dividing dp_size={req.dp_size} ({where}) "
                      "has enough nodes with that many free")


def _strict_layout(ctx: _Ctx, per_node: int, use_master: bool) -> _Layout:
    req = ctx.req
    hosts = [req.master] if use_master and req.master is not None else []
    hosts += [n.node_id for n in ctx.others() if ctx.fits[n.node_id] >= per_node]
    needed = req.dp_size // per_node
    if len(hosts) < needed:
        raise _InfeasibleError(f"{needed} nodes must each fit {per_node} ranks but only {len(hosts)} do")
    return [(h,) for h in hosts[:needed] for _ in range(per_node)]


def _divisors_desc(n: int, cap: int) -> list[int]:
    return [d for d in range(min(n, cap), 0, -1) if n % d == 0]


def span_usable(node: NodeInfo, world_size: int) -> str:
    """Why ``node`` can or cannot be part of a spanning rank ("" means usable)."""
    if node.devices <= 0:
        return "no devices"
    if node.free < node.devices:
        return f"{node.devices - node.free} of {node.devices} busy"
    if world_size % node.devices:
        return f"{node.devices} does not divide world_size={world_size}"
    return ""


def _can_lead(node: NodeInfo) -> bool:
    cpus = node.free_cpus
    return cpus is None or cpus >= 1


def _span(ctx: _Ctx) -> _Layout:
    layout = _span_ranks(ctx, ctx.req.dp_size)
    if len(layout) < ctx.req.dp_size:
        raise _InfeasibleError(f"only {len(layout)} of {ctx.req.dp_size} spanning ranks fit")
    return layout


def _span_ranks(ctx: _Ctx, limit: int) -> _Layout:
    """Up to ``limit`` spanning ranks, master-led first; greedy, so a prefix for any limit."""
    req = ctx.req
    pool = [n for n in ctx.candidates if not span_usable(n, req.world_size)]
    layout: _Layout = []
    master = ctx.master
    if req.dp_size_local != 0 and master is not None and master in pool and _can_lead(master):
        group = _span_group(master, pool, req.world_size)
        if group is not None:
            layout.append(group)
            pool = [n for n in pool if n.node_id not in group]
    if req.dp_size_local == 1 and not layout:
        raise _InfeasibleError(f"dp_size_local=1 but {_span_master_clause(ctx)}")
    # A master that leads no rank hosts none: it must not lead a later rank
    # (master ranks come first) nor lend devices to another node's rank.
    pool = [n for n in pool if n.node_id != req.master]
    # Bigger nodes first: fewer nodes per rank.
    for devices in sorted({n.devices for n in pool}, reverse=True):
        same = sorted((n for n in pool if n.devices == devices), key=lambda n: n.node_id)
        layout += _span_same_size(same, req.world_size // devices, limit - len(layout))
    return layout[:limit]


def _span_same_size(nodes: list[NodeInfo], k: int, limit: int) -> _Layout:
    """Ranks of ``k`` nodes each from equally sized ``nodes`` (sorted by id)."""
    leads = deque(n for n in nodes if _can_lead(n))
    # Followers come from nodes that cannot lead first, saving leaders for later ranks.
    rest = deque(n for n in nodes if not _can_lead(n))
    layout: _Layout = []
    while len(layout) < limit and leads and len(leads) + len(rest) >= k:
        lead = leads.popleft()
        followers = [(rest or leads).popleft() for _ in range(k - 1)]
        layout.append((lead.node_id, *(n.node_id for n in followers)))
    return layout


def _span_group(lead: NodeInfo, pool: list[NodeInfo], world_size: int) -> tuple[str, ...] | None:
    """``lead`` plus enough identical pool nodes for one rank, or None."""
    k = world_size // lead.devices
    peers = [n for n in pool if n.devices == lead.devices and n.node_id != lead.node_id]
    # Keep nodes with a free CPU for later ranks' engine cores where possible.
    peers.sort(key=lambda n: (_can_lead(n), n.node_id))
    if len(peers) < k - 1:
        return None
    return (lead.node_id, *(n.node_id for n in peers[: k - 1]))


def _span_master_clause(ctx: _Ctx) -> str:
    master = ctx.master
    if master is None:
        return _master_clause(ctx)
    why = span_usable(master, ctx.req.world_size)
    if why:
        return f"master node {ctx.short(master.node_id)} cannot span: {why}"
    if not _can_lead(master):
        return f"master node {ctx.short(master.node_id)} has no free CPU for the engine core"
    k = ctx.req.world_size // master.devices
    short = ctx.short(master.node_id)
    return f"master node {short} needs {k - 1} more fully free {master.devices}-device nodes"


# ---------------------------------------------------------------- plan


def _build_plan(inv: Inventory, req: _Request, layout: _Layout) -> PlacementPlan:
    local_counts: dict[str, int] = {}
    ranks = []
    for rank, node_ids in enumerate(layout):
        lead = inv.node(node_ids[0])
        local = local_counts.get(lead.node_id, 0)
        local_counts[lead.node_id] = local + 1
        ranks.append(RankPlacement(
            rank=rank,
            node_id=lead.node_id,
            node_ip=lead.ip,
            local_rank=local,
            is_master=lead.node_id == req.master,
            node_ids=node_ids,
        ))
    return PlacementPlan(
        ranks=tuple(ranks),
        strategy=req.strategy,
        bundle_strategy="PACK" if req.strategy == "span" else "STRICT_PACK",
        world_size=req.world_size,
        accelerator=inv.accelerator,
        master_node_id=req.master,
        dp_size_local=local_counts.get(req.master, 0) if req.master is not None else 0,
    )


# ---------------------------------------------------------------- errors


def _infeasible_message(inv: Inventory, req: _Request, reason: str) -> str:
    ctx = _Ctx(inv, req)
    lines = [f"cannot place {_asked(inv, req)}; {reason}.", _settings(ctx), _node_table(ctx)]
    hints = _suggestions(inv, req)
    lines.append("nearest feasible: " + ("; ".join(hints) if hints else
                                         "none without freeing devices or adding nodes"))
    return "\n".join(lines)


def _asked(inv: Inventory, req: _Request) -> str:
    acc, dp, ws = inv.accelerator, req.dp_size, req.world_size
    head = f"dp_size={dp} x world_size={ws}:"
    if req.strategy == "span":
        return (f"{head} needs {dp * ws} {acc} as ranks spanning fully free identical nodes "
                f"whose {acc} count divides {ws}, plus 1 CPU per rank")
    if acc == CPU:
        return (f"{head} needs {dp * (ws + 1)} CPU ({ws} device + 1 engine core per rank) "
                f"on nodes with >={ws + 1} CPU free")
    return f"{head} needs {dp * ws} {acc} on nodes with >={ws} {acc} free, plus 1 CPU per rank"


def _settings(ctx: _Ctx) -> str:
    req = ctx.req
    parts = [f"strategy={req.strategy}"]
    parts.append(f"dp_size_local={req.dp_size_local if req.dp_size_local is not None else 'auto'}")
    parts.append(f"master={ctx.short(req.master) if req.master else 'none'}")
    if req.allowed is not None:
        parts.append("allowlist=" + ",".join(sorted(ctx.short(n) for n in req.allowed)))
    total = sum(ctx.fits.values()) if req.strategy != "span" else None
    fits = f"; single-node ranks that fit: {total}" if total is not None else ""
    return "asked: " + " ".join(parts) + fits + ". Nodes:"


def _node_table(ctx: _Ctx) -> str:
    acc, req = ctx.inv.accelerator, ctx.req
    last = "span use" if req.strategy == "span" else "ranks fit"
    headers = ["node", "role", "ip", f"{acc} free/total"]
    if acc != CPU:
        headers.append("CPU free")
    headers.append(last)
    rows = []
    for n in ctx.inv.nodes:
        row = [ctx.short(n.node_id), _role(n, req), n.ip or "-", f"{n.free}/{n.devices}"]
        if acc != CPU:
            row.append("?" if n.free_cpus is None else str(n.free_cpus))
        if req.allowed is not None and n.node_id not in req.allowed:
            row.append("not allowed")
        elif req.strategy == "span":
            row.append(span_usable(n, req.world_size) or ("yes" if _can_lead(n) else "yes (no CPU to lead)"))
        else:
            row.append(str(ctx.fits[n.node_id]))
        rows.append(row)
    return render_table(headers, rows)


def _role(node: NodeInfo, req: _Request) -> str:
    roles = [r for r, on in (("head", node.is_head), ("master", node.node_id == req.master)) if on]
    return ",".join(roles) or "-"


def _feasible(inv: Inventory, req: _Request) -> bool:
    try:
        _layout(_Ctx(inv, req))
    except _InfeasibleError:
        return False
    return True


def _suggestions(inv: Inventory, req: _Request) -> list[str]:
    """Nearby settings that would fit: a smaller dp_size, another strategy, fewer constraints."""
    hints = []
    smaller = _largest_fitting_dp(inv, req)
    if smaller:
        hints.append(f"dp_size={smaller} would fit")
    if req.dp_size_local is not None:
        auto = replace(req, dp_size_local=None)
        if _feasible(inv, auto):
            local = _build_plan(inv, auto, _layout(_Ctx(inv, auto))).dp_size_local
            hints.append(f"dp_size_local unset (master hosts {local}) would fit dp_size={req.dp_size}")
    for strategy in STRATEGIES:
        if strategy == req.strategy or (strategy == "span" and inv.accelerator == CPU):
            continue
        if _feasible(inv, replace(req, strategy=strategy, dp_size_local=None)):
            hints.append(f"strategy={strategy!r} would fit dp_size={req.dp_size}")
    if req.allowed is not None and _feasible(inv, replace(req, allowed=None)):
        hints.append(f"dropping the node allowlist would fit dp_size={req.dp_size}")
    return hints


def _largest_fitting_dp(inv: Inventory, req: _Request) -> int | None:
    ctx = _Ctx(inv, req)
    if req.strategy == "span":
        try:
            most = len(_span_ranks(ctx, req.dp_size - 1))
        except _InfeasibleError:
            return None
        return most or None
    # No layout holds more ranks than single-node fits.
    bound = sum(ctx.fits.values())
    local = req.dp_size_local
    for dp in range(min(req.dp_size - 1, bound), 0, -1):
        if local is not None and (local > dp or (req.strategy == "strict" and dp % local)):
            continue
        if _feasible(inv, replace(req, dp_size=dp)):
            return dp
    return None
