"""Thin Ray wrappers: placement groups for a :class:`~raydp.placement.planner.PlacementPlan`.

One group per DP rank, named ``<name>-dp<rank>``, with ``world_size`` device
bundles then one CPU bundle for the engine core. Every bundle carries a
``ray.io/node-id`` label selector naming the node the plan chose for it, which
pins the group even when several nodes share an IP.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raydp.errors import ConfigError, PlacementError, PlacementTimeoutError
from raydp.names import rank_name
from raydp.placement.live import read_inventory
from raydp.placement.planner import CPU, PlacementPlan, rank_bundles
from raydp.placement.report import render_table

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

log = logging.getLogger(__name__)

NODE_ID_LABEL = "ray.io/node-id"
USER_GROUP_STRATEGIES = ("STRICT_PACK", "PACK")
LIFETIMES = (None, "detached")

# Ray does not report a group's bundle label selectors back, so the nodes each
# created group was pinned to are remembered here for wait_ready's timeout report.
_targets: weakref.WeakKeyDictionary[PlacementGroup, tuple[str, ...]] = weakref.WeakKeyDictionary()


def group_name(name: str, rank: int) -> str:
    return rank_name(name, rank)


def create_groups(
    plan: PlacementPlan, name: str, *, lifetime: str | None = None, first_rank: int = 0
) -> list[PlacementGroup]:
    """Create (asynchronously) one placement group per rank of ``plan``.

    ``lifetime`` is passed to Ray: ``None`` (groups die with this driver) or
    ``"detached"``. The plan's rank ``r`` is the cluster's rank ``first_rank + r``
    (ranks added by a scale-up). If creating any group fails, the ones already
    created are removed.
    """
    from ray.util.placement_group import placement_group

    if lifetime not in LIFETIMES:
        raise ConfigError(f"lifetime={lifetime!r}: expected None or 'detached'")
    _check_names_free(name, range(first_rank, first_rank + plan.dp_size))
    groups: list[PlacementGroup] = []
    try:
        for r in plan.ranks:
            selector = [{NODE_ID_LABEL: node} for node in plan.bundle_node_ids(r.rank)]
            group = placement_group(
                bundles=plan.bundles(),
                strategy=plan.bundle_strategy,
                name=group_name(name, first_rank + r.rank),
                lifetime=lifetime,
                bundle_label_selector=selector,
            )
            groups.append(group)
            _targets[group] = r.node_ids
    except BaseException:
        remove_groups(groups)
        raise
    return groups


def create_unpinned_groups(
    name: str, ranks: range, world_size: int, accelerator: str, *, span: bool, lifetime: str | None = None
) -> list[PlacementGroup]:
    """Groups for ``ranks`` that no node can hold yet: Ray keeps them pending (an autoscaler sees
    the demand and may add nodes) and places them wherever they fit first."""
    from ray.util.placement_group import placement_group

    _check_names_free(name, ranks)
    groups: list[PlacementGroup] = []
    try:
        for rank in ranks:
            groups.append(
                placement_group(
                    bundles=rank_bundles(world_size, accelerator),
                    strategy="PACK" if span else "STRICT_PACK",
                    name=group_name(name, rank),
                    lifetime=lifetime,
                )
            )
    except BaseException:
        remove_groups(groups)
        raise
    return groups


def _check_names_free(name: str, ranks: range) -> None:
    from ray.util.placement_group import get_placement_group

    for rank in ranks:
        try:
            get_placement_group(group_name(name, rank))
        except ValueError:
            continue  # Ray's way of saying "no group by that name"
        raise ConfigError(
            f"name={name!r}: placement group {group_name(name, rank)!r} already exists "
            "(another raydp cluster with this name?); close it or pick another name"
        )


def wait_ready(
    groups: Sequence[PlacementGroup],
    timeout_s: float,
    *,
    plan: PlacementPlan | None = None,
) -> None:
    """Wait until every group is created, at most ``timeout_s`` seconds.

    On timeout raises :class:`PlacementTimeoutError` naming each pending group,
    its state, the bundles it waits for and its target node (from ``plan``, or
    as remembered by :func:`create_groups`), with every node's current capacity.
    Removes nothing: the caller owns the groups.
    """
    import ray

    if not groups:
        return
    refs = {g.ready(): i for i, g in enumerate(groups)}
    ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=max(timeout_s, 0.0))
    for ref in ready:
        try:
            ray.get(ref, timeout=max(timeout_s, 1.0))
        except Exception as exc:  # a group removed while we waited, GCS errors...
            raise PlacementError(f"placement group {_name_of(groups[refs[ref]])} failed: {exc}") from exc
    if pending:
        stuck = sorted(refs[ref] for ref in pending)
        raise PlacementTimeoutError(_timeout_message(groups, stuck, timeout_s, plan))


def _name_of(group: PlacementGroup) -> str:
    table = _table(group)
    return str(table.get("name") or group.id.hex())


def _table(group: PlacementGroup) -> dict[str, Any]:
    from ray.util.placement_group import placement_group_table

    try:
        return dict(placement_group_table(group) or {})
    except Exception:  # best effort: a table we cannot read is reported as unknown
        return {}


def _timeout_message(
    groups: Sequence[PlacementGroup],
    stuck: list[int],
    timeout_s: float,
    plan: PlacementPlan | None,
) -> str:
    rows = []
    for i in stuck:
        table = _table(groups[i])
        stats = table.get("stats") or {}
        nodes = plan.ranks[i].node_ids if plan and i < plan.dp_size else _targets.get(groups[i], ())
        target = "+".join(n[:8] for n in nodes) or "?"
        rows.append(
            [
                str(table.get("name") or groups[i].id.hex()),
                str(table.get("state", "UNKNOWN")),
                str(stats.get("scheduling_state", "?")),
                f"{_describe_bundles(groups[i].bundle_specs)} ({table.get('strategy', '?')})",
                target,
            ]
        )
    head = (
        f"{len(stuck)} of {len(groups)} placement groups not ready after {timeout_s:g}s "
        "(pending groups are left in place for the caller to remove):"
    )
    body = render_table(("group", "state", "scheduling", "waits for", "target node"), rows)
    accelerator = plan.accelerator if plan else _accelerator_of(groups[stuck[0]].bundle_specs)
    return "\n".join([head, body, _capacity_now(accelerator)])


def _describe_bundles(bundles: Sequence[dict[str, float]] | None) -> str:
    """``2x{GPU: 1} + {CPU: 1}``: runs of identical bundles collapsed."""
    runs: list[tuple[int, str]] = []
    for b in bundles or []:
        text = "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(b.items())) + "}"
        if runs and runs[-1][1] == text:
            runs[-1] = (runs[-1][0] + 1, text)
        else:
            runs.append((1, text))
    return " + ".join(text if n == 1 else f"{n}x{text}" for n, text in runs) or "(no bundles)"


def _accelerator_of(bundles: Sequence[dict[str, float]] | None) -> str:
    first = (bundles or [{}])[0]
    return next((k for k in first if k != CPU), CPU)


def _capacity_now(accelerator: str) -> str:
    try:
        inv = read_inventory(accelerator)
    except Exception as exc:  # the report must not hide the timeout itself
        return f"node capacity unavailable: {exc}"
    rows = [
        [
            inv.short(n.node_id),
            "head" if n.is_head else "-",
            n.ip or "-",
            f"{n.free}/{n.devices}",
            "?" if n.free_cpus is None else str(n.free_cpus),
        ]
        for n in inv.nodes
    ]
    headers = ("node", "role", "ip", f"{accelerator} free/total", "CPU free")
    return "node capacity now:\n" + render_table(headers, rows)


def remove_groups(groups: Sequence[PlacementGroup]) -> None:
    """Remove every group; already-removed groups are fine, other errors are logged."""
    from ray.util.placement_group import remove_placement_group

    for group in groups:
        try:
            remove_placement_group(group)
        except Exception as exc:  # close() must go on removing the others
            log.warning("could not remove placement group %s: %s", group.id.hex(), exc)
    _wait_removed(groups, timeout_s=5.0)


def _wait_removed(groups: Sequence[PlacementGroup], timeout_s: float) -> None:
    """Removal is asynchronous: wait (bounded) so freed resources are visible on return."""
    import ray

    deadline = time.monotonic() + timeout_s
    pending = {g.id.hex() for g in groups}
    while pending and time.monotonic() < deadline:
        # A removed group's bundle resources ("CPU_group_<id>") leave the
        # cluster's resource view only once the freed resources are back.
        keys = " ".join(ray.available_resources())
        pending = {gid for gid in pending if gid in keys}
        if pending:
            time.sleep(0.02)


def validate_user_groups(
    groups: Sequence[PlacementGroup],
    *,
    dp_size: int,
    world_size: int,
    accelerator: str,
    strategies: Collection[str] = USER_GROUP_STRATEGIES,
) -> None:
    """Check user-provided groups fit the layout; ConfigError lists every problem."""
    if len(groups) != dp_size:
        raise ConfigError(f"placement_groups: got {len(groups)} groups, dp_size={dp_size} needs exactly one per rank")
    problems: list[str] = []
    seen: dict[str, int] = {}
    shape = _Shape(world_size, accelerator, tuple(strategies))
    for i, group in enumerate(groups):
        problems += [f"placement_groups[{i}]: {p}" for p in _group_problems(group, i, seen, shape)]
    if problems:
        expected = _describe_bundles(rank_bundles(world_size, accelerator))
        raise ConfigError("invalid placement groups (each needs " + expected + "): " + "; ".join(problems))


@dataclass(frozen=True)
class _Shape:
    """What every user group must look like."""

    world_size: int
    accelerator: str
    strategies: tuple[str, ...]


def _group_problems(group: object, index: int, seen: dict[str, int], shape: _Shape) -> list[str]:
    from ray.util.placement_group import PlacementGroup

    if not isinstance(group, PlacementGroup) or group.is_empty:
        return [f"expected a PlacementGroup, got {group!r:.80}"]
    gid = group.id.hex()
    if gid in seen:
        return [f"is the same group as placement_groups[{seen[gid]}]"]
    seen[gid] = index
    table = _table(group)
    state = table.get("state", "REMOVED" if not table else "UNKNOWN")
    if state == "REMOVED":
        return [f"group {table.get('name') or gid} is REMOVED"]
    problems = []
    if table.get("strategy") not in shape.strategies:
        problems.append(f"strategy {table.get('strategy')!r}, expected one of {', '.join(shape.strategies)}")
    bundles = [dict(b) for _, b in sorted((table.get("bundles") or {}).items())]
    problems += _bundle_problems(bundles, shape.world_size, shape.accelerator)
    return problems


def _bundle_problems(bundles: list[dict[str, float]], world_size: int, accelerator: str) -> list[str]:
    if len(bundles) != world_size + 1:
        return [
            f"{len(bundles)} bundles ({_describe_bundles(bundles)}), "
            f"expected {world_size + 1} (world_size={world_size} devices + 1 engine core)"
        ]
    problems = [
        f"bundle {j} is {_describe_bundles([b])}, needs {accelerator} >= 1"
        for j, b in enumerate(bundles[:world_size])
        if float(b.get(accelerator, 0.0)) < 1.0
    ]
    if float(bundles[-1].get(CPU, 0.0)) < 1.0:
        last = _describe_bundles(bundles[-1:])
        problems.append(f"last bundle is {last}, needs CPU >= 1 for the engine core")
    return problems
