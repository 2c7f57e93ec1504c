"""What the connected Ray cluster holds right now: the thin Ray wrapper of placement.

Kept apart from :mod:`raydp.placement.inventory` so that the planner and its
types never import Ray (an import contract checks it).
"""

from __future__ import annotations

from raydp.errors import ConfigError
from raydp.placement.inventory import Inventory, inventory_from_nodes


def read_inventory(accelerator: str = "GPU") -> Inventory:
    """Read the inventory of the Ray cluster this process is connected to."""
    import ray
    from ray._private.state import available_resources_per_node

    if not ray.is_initialized():
        raise ConfigError("read_inventory needs a connected Ray: call ray.init(address=...) first")
    nodes = ray.nodes()
    # Per-node *available* counts are only exposed by this developer API;
    # cluster-wide ray.available_resources() cannot tell nodes apart.
    free = available_resources_per_node()
    return inventory_from_nodes(nodes, free, accelerator)
