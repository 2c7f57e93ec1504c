"""One numbering of LoRA adapters for every API server, and finding an adapter another server loaded."""

from __future__ import annotations

import asyncio

from vllm.lora.request import LoRARequest

from raydp.client.adapters import AdapterIndex
from raydp.models.vllm.adapters import VllmAdapters
from raydp.serve.vllm_loras import ID_SPACE, AdapterReloads, ClusterLoraResolver, LoraIds, cluster_lora_id
from raydp.serve.vllm_unloads import ClusterUnloads
from raydp.wire.adapters import AdapterState
from raydp.wire.control import StatsSnapshot


def test_two_servers_numbering_one_adapter_differently_send_the_ranks_one_number() -> None:
    first, second = LoraIds(), LoraIds()
    a = first.outgoing(LoRARequest("ad2", 2, "/adapters/ad2"))
    b = second.outgoing(LoRARequest("ad2", 7, "/adapters/ad2"))
    assert a.lora_int_id == b.lora_int_id == cluster_lora_id("ad2", "/adapters/ad2")
    other = second.outgoing(LoRARequest("ad3", 2, "/adapters/ad3"))
    assert other.lora_int_id != a.lora_int_id, "one server's 2 is not another adapter's 2 on the ranks"


def test_numbers_come_back_as_the_servers_own_and_the_request_is_not_changed() -> None:
    ids = LoraIds()
    original = LoRARequest("ad1", 1, "/a")
    sent = ids.outgoing(original)
    assert original.lora_int_id == 1, "a copy goes out"
    assert ids.cluster_id(1) == sent.lora_int_id
    assert ids.local_ids({sent.lora_int_id, 12345}) == {1}
    assert ids.outgoing(None) is None


def test_cluster_numbers_are_positive_int32s() -> None:
    assert all(1 <= cluster_lora_id(f"ad{i}", f"/p/{i}") <= ID_SPACE for i in range(200))


def test_the_resolver_finds_an_adapter_some_rank_was_given() -> None:
    index = AdapterIndex(2)
    index.on_snapshot([AdapterState(slots=2), AdapterState(["ad2"], 2)], {"ad2": "/adapters/ad2"})
    resolver = ClusterLoraResolver(index.known)
    found = asyncio.run(resolver.resolve_lora("base", "ad2"))
    assert found is not None and (found.lora_name, found.lora_path) == ("ad2", "/adapters/ad2")
    assert asyncio.run(resolver.resolve_lora("base", "nope")) is None


class FakeCore:
    """The one engine-core call ``VllmAdapters`` makes: which adapter ids vLLM's worker holds."""

    def __init__(self) -> None:
        self.held: set[int] = set()

    def list_loras(self) -> set[int]:
        return set(self.held)


def test_a_vllm_ranks_report_names_its_adapters_least_recently_used_first() -> None:
    core = FakeCore()
    adapters = VllmAdapters(core, slots=2)
    adapters.named(LoRARequest("a", 11, "/a"))
    adapters.arrived(LoRARequest("b", 12, "/b"))
    core.held = {11, 12}
    adapters.arrived(LoRARequest("a", 11, "/a"))
    state = adapters.state(now=0.0)
    assert state.resident == ["b", "a"] and state.known == {"a": "/a", "b": "/b"}
    assert (state.loads, state.evictions, state.requests, state.hits) == (2, 0, 2, 0)
    core.held = {11}
    later = adapters.state(now=1.0)
    assert later.resident == ["a"] and later.evictions == 1


def snap(dead: dict[int, str], adapters: list[AdapterState], paths: dict[str, str] | None = None) -> StatsSnapshot:
    counts = [(0, 0)] * len(adapters)
    return StatsSnapshot(counts, 0, False, dead=dead, adapters=adapters, adapter_paths=paths or {})


def test_a_rank_back_from_the_dead_is_due_the_adapters_it_held() -> None:
    reloads = AdapterReloads()
    known = {"a": "/a", "b": "/b", "c": "/c"}
    assert reloads.due(snap({}, [AdapterState(["a", "b"], 2), AdapterState(["c"], 2)], known)) == []
    assert reloads.due(snap({0: "killed"}, [AdapterState(), AdapterState(["c"], 2)], known)) == []
    ((rank, loras),) = reloads.due(snap({}, [AdapterState(slots=2), AdapterState(["c"], 2)]))
    assert rank == 0 and [(r.lora_name, r.lora_path, r.lora_int_id) for r in loras] == [
        ("a", "/a", cluster_lora_id("a", "/a")),
        ("b", "/b", cluster_lora_id("b", "/b")),
    ]
    assert reloads.due(snap({}, [AdapterState(["a", "b"], 2), AdapterState(["c"], 2)])) == [], "once"


def test_a_rank_that_held_nothing_is_due_nothing() -> None:
    reloads = AdapterReloads()
    reloads.due(snap({}, [AdapterState(slots=2)]))
    reloads.due(snap({0: "killed"}, [AdapterState()]))
    assert reloads.due(snap({}, [AdapterState(slots=2)])) == []


def test_an_unloaded_adapter_is_freed_reported_unloaded_and_back_once_given_again() -> None:
    core = FakeCore()
    adapters = VllmAdapters(core, slots=2)
    adapters.named(LoRARequest("a", 11, "/a"))
    adapters.arrived(LoRARequest("b", 12, "/b"))
    assert adapters.forget("a") == [11], "the ids for the engine to remove"
    state = adapters.state(now=0.0)
    assert state.known == {"b": "/b"} and state.unloaded == ["a"]
    adapters.arrived(LoRARequest("a", 11, "/a"))  # from a server that has not heard of the unload yet
    assert adapters.state(now=1.0).known == {"b": "/b"}, "a late request does not offer it again"
    adapters.named(LoRARequest("a", 11, "/a"))  # add_lora: loaded again
    again = adapters.state(now=2.0)
    assert again.known == {"a": "/a", "b": "/b"} and again.unloaded == []
    assert adapters.forget("nope") == [] and adapters.state(now=3.0).unloaded == ["nope"]


class SnapshotOnly:
    """The one client call ``ClusterUnloads.prune`` makes: the coordinator's latest snapshot."""

    def __init__(self, snapshot: StatsSnapshot) -> None:
        self.snap = snapshot

    def snapshot(self) -> StatsSnapshot:
        return self.snap


def test_a_server_drops_what_another_unloaded_unless_it_gave_it_again_lately() -> None:
    clock = [100.0]
    reports = [AdapterState(unloaded=["a", "b"]), AdapterState(unloaded=["c"])]
    client = SnapshotOnly(snap({}, reports, {"b": "/b"}))  # b: loaded again somewhere, offered again
    unloads = ClusterUnloads(client, clock=lambda: clock[0])  # type: ignore[arg-type]
    unloads.added("c")  # this server loaded c again a moment ago: the reports may not show it yet
    table = {"a": 1, "b": 2, "c": 3, "d": 4}
    unloads.prune(table)
    assert table == {"b": 2, "c": 3, "d": 4}
    clock[0] += ClusterUnloads.GRACE_S + 1
    unloads.prune(table)
    assert table == {"b": 2, "d": 4}, "past the grace, the reports are the truth"


def test_adds_past_the_grace_are_forgotten_without_changing_what_is_dropped() -> None:
    clock = [100.0]
    reports = [AdapterState(unloaded=["c", "e"])]
    unloads = ClusterUnloads(SnapshotOnly(snap({}, reports, {})), clock=lambda: clock[0])  # type: ignore[arg-type]
    unloads.added("c")
    clock[0] += ClusterUnloads.GRACE_S + 1
    unloads.added("e")  # forgets c's add, which no longer counted
    table = {"c": 1, "e": 2}
    unloads.prune(table)
    assert table == {"e": 2}, "c was added too long ago to be kept; e was added a moment ago"
