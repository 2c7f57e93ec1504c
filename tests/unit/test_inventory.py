"""Parsing ``ray.nodes()``-shaped dicts into an Inventory (no Ray)."""

from __future__ import annotations

from typing import Any

import pytest

from raydp.errors import ConfigError
from raydp.placement.inventory import (
    HEAD_RESOURCE,
    Inventory,
    NodeInfo,
    inventory_from_nodes,
    resolve_node_id,
    short_ids,
    whole,
)

pytestmark = pytest.mark.timeout(30)

HEAD = "a1b2c3d4" + "0" * 48
W1 = "a1b2ffff" + "1" * 48
W2 = "c0ffee00" + "2" * 48
DEAD = "deadbeef" + "3" * 48


def raw_node(
    node_id: str,
    *,
    gpus: float = 4,
    cpus: float = 2,
    head: bool = False,
    alive: bool = True,
    ip: str = "192.0.2.2",
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    resources: dict[str, float] = {"CPU": cpus, "memory": 1e9, f"node:{ip}": 1.0}
    if gpus:
        resources["GPU"] = gpus
    if head:
        resources[HEAD_RESOURCE] = 1.0
    return {
        "NodeID": node_id,
        "Alive": alive,
        "NodeManagerAddress": ip,
        "Resources": resources,
        "Labels": {"ray.io/node-id": node_id, **(labels or {})},
    }


NODES = [
    raw_node(W2, gpus=2),
    raw_node(HEAD, gpus=4, head=True),
    raw_node(DEAD, gpus=8, alive=False),
    raw_node(W1, gpus=4, labels={"zone": "b"}),
]


def test_parses_alive_nodes_head_first_then_by_id() -> None:
    inv = inventory_from_nodes(NODES, None, "GPU")
    assert [n.node_id for n in inv.nodes] == [HEAD, W1, W2]
    assert inv.head is not None and inv.head.node_id == HEAD
    assert [n.is_head for n in inv.nodes] == [True, False, False]
    assert inv.accelerator == "GPU"


def test_shared_ip_nodes_stay_distinct() -> None:
    inv = inventory_from_nodes(NODES, None, "GPU")
    assert {n.ip for n in inv.nodes} == {"192.0.2.2"}
    assert len(inv.nodes) == 3
    assert inv.node(W1).total == 4 and inv.node(W2).total == 2


def test_available_none_means_idle() -> None:
    inv = inventory_from_nodes(NODES, None, "GPU")
    for n in inv.nodes:
        assert n.available == n.total
        assert n.cpus_available == 2


def test_available_per_node_is_used_and_missing_means_zero() -> None:
    # Ray drops a resource from a node's available map when none is left.
    available = {HEAD: {"GPU": 1.0, "CPU": 1.0}, W1: {"CPU": 2.0}}
    inv = inventory_from_nodes(NODES, available, "GPU")
    assert (inv.node(HEAD).total, inv.node(HEAD).available, inv.node(HEAD).cpus_available) == (4, 1, 1)
    assert inv.node(W1).available == 0 and inv.node(W1).cpus_available == 2
    assert inv.node(W2).available == 0 and inv.node(W2).cpus_available == 0


def test_other_accelerators_and_labels() -> None:
    nodes = [raw_node(HEAD, head=True), {**raw_node(W1), "Resources": {"CPU": 8.0, "TPU": 4.0}}]
    inv = inventory_from_nodes(nodes, None, "TPU")
    assert inv.node(HEAD).total == 0 and inv.node(W1).total == 4
    assert inv.node(W1).labels["ray.io/node-id"] == W1
    cpu = inventory_from_nodes(nodes, None, "CPU")
    assert cpu.node(W1).total == 8 and cpu.node(W1).available == 8


def test_lowercase_alive_key_and_no_head() -> None:
    nodes = [{"NodeID": W1, "alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"GPU": 1.0}}]
    inv = inventory_from_nodes(nodes, None, "GPU")
    assert inv.head is None
    assert inv.node(W1).labels == {}


def test_node_without_id_and_duplicate_ids_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="NodeID"):
        inventory_from_nodes([{"Alive": True, "Resources": {}}], None, "GPU")
    with pytest.raises(ConfigError, match="duplicate"):
        inventory_from_nodes([raw_node(W1), raw_node(W1)], None, "GPU")
    with pytest.raises(ConfigError, match="accelerator"):
        inventory_from_nodes(NODES, None, "")


def test_node_info_is_hashable_and_labels_are_copied() -> None:
    labels = {"zone": "a"}
    n = NodeInfo(node_id="x", ip="1.2.3.4", labels=labels, total=2, available=2)
    labels["zone"] = "b"
    assert n.labels == {"zone": "a"}
    assert hash(n) == hash(NodeInfo(node_id="x", ip="1.2.3.4", labels={"zone": "c"}, total=2, available=2))


@pytest.mark.parametrize(
    ("amount", "expected"), [(3.9999999, 4), (3.5, 3), (0.0, 0), (-1.0, 0), (float("nan"), 0), (float("inf"), 0)]
)
def test_whole_units(amount: float, expected: int) -> None:
    assert whole(amount) == expected


def test_short_ids_are_unique_prefixes() -> None:
    ids = [HEAD, W1, W2, "a1b2c3d4" + "9" * 48, "n1", "n2"]
    short = short_ids(ids)
    assert len(set(short.values())) == len(ids)
    for nid, s in short.items():
        assert nid.startswith(s)
    assert short[W2] == "c0ffee00"
    assert short[HEAD] == "a1b2c3d40"  # shares 8 characters with another id


def test_resolve_exact_and_prefix() -> None:
    ids = [HEAD, W1, W2]
    assert resolve_node_id(ids, W1) == W1
    assert resolve_node_id(ids, "c0ff") == W2
    assert resolve_node_id(ids, "a1b2c") == HEAD


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("a1b2", "ambiguous"),
        ("abc", ">= 4 characters"),
        ("ffff0000", "matches no alive node"),
    ],
)
def test_resolve_errors_list_known_nodes(value: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_node_id([HEAD, W1, W2], value, "master_node_id")
    msg = str(info.value)
    assert fragment in msg and f"master_node_id={value!r}" in msg
    assert "c0ffee00" in msg and "a1b2c3d4" in msg


def test_inventory_node_lookup_is_config_error() -> None:
    inv = Inventory((NodeInfo(node_id=W1, ip="1.1.1.1"),), "GPU")
    with pytest.raises(ConfigError, match="unknown node id"):
        inv.node("nope")
    assert inv.short("unknown-node-id") == "unknown-"
