"""How a cluster's Ray objects are named, so that ``attach`` and ``shutdown`` find them.

Actors and placement groups are named after the cluster, so several raydp
clusters share one Ray cluster and another process can look one up by name.
"""

from __future__ import annotations

NAMESPACE = "raydp"  # the Ray namespace every raydp actor lives in


def rank_name(cluster: str, rank: int) -> str:
    """Rank ``rank``'s engine actor and its placement group."""
    return f"{cluster}-dp{rank}"


def coordinator_name(cluster: str) -> str:
    return f"{cluster}-coordinator"


def supervisor_name(cluster: str) -> str:
    """The actor that supervises a detached cluster from inside it (restarts, scaling, close)."""
    return f"{cluster}-supervisor"
