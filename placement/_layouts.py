"""The per-strategy layout search, private to the planner.

Kept apart from validation and from error messages: these functions only decide
which nodes host which ranks, and say in one clause why a request does not fit.
:mod:`raydp.placement._explain` reuses them to probe nearby settings.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from raydp.config import PlacementStrategy
from raydp.errors import RaydpError
from raydp.placement.inventory import Inventory, NodeInfo
from raydp.placement.plan import CPU, PlacementPlan, RankPlacement


def ranks_fit(node: NodeInfo, accelerator: str, world_size: int) -> int:
    """How many single-node ranks of ``world_size`` devices fit on ``node`` now."""
    if accelerator == CPU:
        # Device bundles and the engine core draw on the same CPUs.
        return node.free // (world_size + 1)
    by_devices = node.free // world_size
    cpus = node.free_cpus
    return by_devices if cpus is None else min(by_devices, cpus)


@dataclass(frozen=True)
class Request:
    dp_size: int
    world_size: int
    dp_size_local: int | None
    strategy: PlacementStrategy
    master: str | None
    allowed: frozenset[str] | None


class InfeasibleError(RaydpError):
    """Internal: the request does not fit; the message says why (one clause)."""


@dataclass
class Ctx:
    """A request seen against an inventory: the nodes it may use and their fits."""

    inv: Inventory
    req: Request
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
Layout = list[tuple[str, ...]]


# ---------------------------------------------------------------- layouts


def find_layout(ctx: Ctx) -> Layout:
    if ctx.req.strategy == "fill":
        return _fill(ctx)
    if ctx.req.strategy == "strict":
        return _strict(ctx)
    return _span(ctx)


def _master_clause(ctx: Ctx) -> str:
    m = ctx.req.master
    if m is None:
        return "there is no master node"
    if ctx.master is None:
        return f"master node {ctx.short(m)} is not in the node allowlist"
    return f"master node {ctx.short(m)} fits {ctx.master_fit()}"


def _fill(ctx: Ctx) -> Layout:
    req = ctx.req
    local = min(ctx.master_fit(), req.dp_size) if req.dp_size_local is None else req.dp_size_local
    if local > ctx.master_fit():
        raise InfeasibleError(f"dp_size_local={local} but {_master_clause(ctx)}")
    layout: Layout = [(req.master,)] * local if req.master is not None else []
    for node in ctx.others():
        take = min(ctx.fits[node.node_id], req.dp_size - len(layout))
        layout += [(node.node_id,)] * take
    if len(layout) < req.dp_size:
        raise InfeasibleError(f"only {len(layout)} of {req.dp_size} ranks fit")
    return layout


def _strict(ctx: Ctx) -> Layout:
    req = ctx.req
    mfit = ctx.master_fit()
    if req.dp_size_local is not None:
        per_node = req.dp_size_local
        if per_node > mfit:
            raise InfeasibleError(f"dp_size_local={per_node} but {_master_clause(ctx)}")
        return _strict_layout(ctx, per_node, use_master=True)
    use_master = mfit >= 1
    cap = min(mfit, req.dp_size) if use_master else req.dp_size
    for per_node in _divisors_desc(req.dp_size, cap):
        try:
            return _strict_layout(ctx, per_node, use_master)
        except InfeasibleError:
            continue
    where = f"at most the master's {mfit}" if use_master else "the master hosts none"
    raise InfeasibleError(
        f"no per-node rank count dividing dp_size={req.dp_size} ({where}) has enough nodes with that many free"
    )


def _strict_layout(ctx: Ctx, per_node: int, use_master: bool) -> Layout:
    req = ctx.req
    hosts = [req.master] if use_master and req.master is not None else []
    hosts += [n.node_id for n in ctx.others() if ctx.fits[n.node_id] >= per_node]
    needed = req.dp_size // per_node
    if len(hosts) < needed:
        raise InfeasibleError(f"{needed} nodes must each fit {per_node} ranks but only {len(hosts)} do")
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


def can_lead(node: NodeInfo) -> bool:
    cpus = node.free_cpus
    return cpus is None or cpus >= 1


def _span(ctx: Ctx) -> Layout:
    layout = span_ranks(ctx, ctx.req.dp_size)
    if len(layout) < ctx.req.dp_size:
        raise InfeasibleError(f"only {len(layout)} of {ctx.req.dp_size} spanning ranks fit")
    return layout


def span_ranks(ctx: Ctx, limit: int) -> Layout:
    """Up to ``limit`` spanning ranks, master-led first; greedy, so a prefix for any limit."""
    req = ctx.req
    pool = [n for n in ctx.candidates if not span_usable(n, req.world_size)]
    layout: Layout = []
    master = ctx.master
    if req.dp_size_local != 0 and master is not None and master in pool and can_lead(master):
        group = _span_group(master, pool, req.world_size)
        if group is not None:
            layout.append(group)
            pool = [n for n in pool if n.node_id not in group]
    if req.dp_size_local == 1 and not layout:
        raise InfeasibleError(f"dp_size_local=1 but {_span_master_clause(ctx)}")
    # A master that leads no rank hosts none: it must not lead a later rank
    # (master ranks come first) nor lend devices to another node's rank.
    pool = [n for n in pool if n.node_id != req.master]
    # Bigger nodes first: fewer nodes per rank.
    for devices in sorted({n.devices for n in pool}, reverse=True):
        same = sorted((n for n in pool if n.devices == devices), key=lambda n: n.node_id)
        layout += _span_same_size(same, req.world_size // devices, limit - len(layout))
    return layout[:limit]


def _span_same_size(nodes: list[NodeInfo], k: int, limit: int) -> Layout:
    """Ranks of ``k`` nodes each from equally sized ``nodes`` (sorted by id)."""
    leads = deque(n for n in nodes if can_lead(n))
    # Followers come from nodes that cannot lead first, saving leaders for later ranks.
    rest = deque(n for n in nodes if not can_lead(n))
    layout: Layout = []
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
    peers.sort(key=lambda n: (can_lead(n), n.node_id))
    if len(peers) < k - 1:
        return None
    return (lead.node_id, *(n.node_id for n in peers[: k - 1]))


def _span_master_clause(ctx: Ctx) -> str:
    master = ctx.master
    if master is None:
        return _master_clause(ctx)
    why = span_usable(master, ctx.req.world_size)
    if why:
        return f"master node {ctx.short(master.node_id)} cannot span: {why}"
    if not can_lead(master):
        return f"master node {ctx.short(master.node_id)} has no free CPU for the engine core"
    k = ctx.req.world_size // master.devices
    short = ctx.short(master.node_id)
    return f"master node {short} needs {k - 1} more fully free {master.devices}-device nodes"


# ---------------------------------------------------------------- plan


def build_plan(inv: Inventory, req: Request, layout: Layout) -> PlacementPlan:
    local_counts: dict[str, int] = {}
    ranks = []
    for rank, node_ids in enumerate(layout):
        lead = inv.node(node_ids[0])
        local = local_counts.get(lead.node_id, 0)
        local_counts[lead.node_id] = local + 1
        ranks.append(
            RankPlacement(
                rank=rank,
                node_id=lead.node_id,
                node_ip=lead.ip,
                local_rank=local,
                is_master=lead.node_id == req.master,
                node_ids=node_ids,
            )
        )
    return PlacementPlan(
        ranks=tuple(ranks),
        strategy=req.strategy,
        bundle_strategy="PACK" if req.strategy == "span" else "STRICT_PACK",
        world_size=req.world_size,
        accelerator=inv.accelerator,
        master_node_id=req.master,
        dp_size_local=local_counts.get(req.master, 0) if req.master is not None else 0,
    )
