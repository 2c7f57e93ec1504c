"""Resizing one pool of a prefill/decode (P/D) cluster: the new sizes, and the order of the steps.

A P/D cluster's ranks stay dense: ``0..P-1`` prefill and ``P..N-1`` decode
(``ClusterEndpoints.prefill_ranks`` is ``P``). Every rank runs the same
engine, with a connector that both stores and loads KV (``kv_both``), so a
rank's pool is only a routing decision. Moving the boundary ``P`` switches
ranks between pools without restarting anything; a request already on a
switched rank finishes there.

- **The decode pool** resizes the way an unpooled cluster does: ranks are
  added or removed at the top, and the boundary stays.
- **The prefill pool** going to ``P'`` keeps the decode pool's size. The
  cluster resizes by ``P' - P`` at the top, and the boundary moves to ``P'``.
  - Growing: the new ranks join first, as decode ranks; then the boundary
    moves up, and the ranks below it now prefill.
  - Shrinking: the boundary moves down first; then the highest ranks drain
    and go.

  Either way, no pool drops below the smaller of its old and new sizes in
  between, and a new rank gets traffic only once it has joined.

:func:`plan` is the pure part (the property tests and ``raydp scale`` use
it); :class:`~raydp.orchestration.scaling.ScaleChange` runs the steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from raydp.errors import ConfigError

POOLS = ("prefill", "decode")


@dataclass(frozen=True)
class PoolPlan:
    """A scale change's targets: ``dp_size`` ranks in all, the first ``prefill`` of them prefilling."""

    dp_size: int
    prefill: int  # the boundary after the change (0: the cluster has no pools)


def plan(prefill: int, dp_size: int, pool: str | None, size: int) -> PoolPlan:
    """The targets for ``pool`` to have ``size`` ranks, in a cluster of ``dp_size`` whose first ``prefill`` prefill.

    ``pool`` None resizes an unpooled cluster. Raises ConfigError naming the
    field for a pool this cluster does not have, or a size that would empty a pool.
    """
    if not prefill:
        if pool is not None:
            raise ConfigError(f"pool={pool!r}: this cluster has no P/D pools; leave pool out")
        return PoolPlan(size, 0)
    if pool not in POOLS:
        raise ConfigError(f"pool={pool!r}: a P/D cluster scales one pool at a time; allowed: 'prefill', 'decode'")
    if size < 1:
        raise ConfigError(f"dp_size={size}: the {pool} pool needs at least 1 rank")
    if pool == "decode":
        return PoolPlan(prefill + size, prefill)
    return PoolPlan(dp_size + size - prefill, size)


__all__ = ["POOLS", "PoolPlan", "plan"]
