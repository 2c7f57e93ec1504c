"""What a rank holds of LoRA adapters: the reference engines' slots, the reports, the coordinator's copy."""

from __future__ import annotations

import msgspec
import pytest

from raydp.coordinator.publish import describe, snapshot
from raydp.coordinator.state import CoordinatorState
from raydp.engine.adapter_report import AdapterReporter
from raydp.engine.core import EngineContext
from raydp.errors import ConfigError, DeathCause
from raydp.models.adapter_slots import AdapterSlots
from raydp.models.echo import EchoEngine
from raydp.wire.adapters import MAX_ADAPTER_NAME, AdapterState, check_adapter_name
from raydp.wire.codec import encode
from raydp.wire.control import AdapterReport, EngineDead, coordinator_decoder
from raydp.wire.protocol import Request

CONTEXT = EngineContext(rank=0, local_rank=0, dp_size=1, world_size=1, node_id="n")


def test_slots_evict_the_least_recently_used_adapter_no_running_request_uses() -> None:
    slots = AdapterSlots(2)
    assert slots.take("a") is True and slots.take("b") is True
    slots.release("a")
    slots.release("b")
    assert slots.take("a") is False, "held: no load"
    slots.release("a")
    assert slots.take("c") is True, "b is the least recently used"
    assert slots.state().resident == ["a", "c"]
    assert (slots.loads, slots.evictions) == (3, 1)


def test_a_request_waits_while_every_slot_is_in_use() -> None:
    slots = AdapterSlots(1)
    assert slots.take("a") is True
    assert slots.take("b") is None, "a runs: it cannot be evicted"
    slots.release("a")
    assert slots.take("b") is True


@pytest.mark.parametrize(("slots", "load_s", "said"), [(0, 0.0, "max_loras=0"), (2, -1.0, "adapter_load_s=-1.0")])
def test_bad_slot_settings_are_refused_naming_them(slots: int, load_s: float, said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        AdapterSlots(slots, load_s)


def request(rid: str, adapter: str = "", max_tokens: int = 2) -> Request:
    return Request(rid, [1, 2], max_tokens, adapter=adapter)


def test_the_echo_engine_runs_adapters_in_its_slots_and_reports_them() -> None:
    engine = EchoEngine(CONTEXT, max_loras=1)
    engine.add_request(request("r1", "a"))
    engine.add_request(request("r2", "b"))
    engine.add_request(request("r3", ""))
    engine.step()
    assert engine.load() == (1, 2), "b waits for a's slot; the base-model request runs"
    while engine.has_unfinished():
        engine.step()
    state = engine.adapters()
    assert state is not None
    assert (state.resident, state.slots, state.loads, state.evictions, state.requests, state.hits) == (
        ["b"],
        1,
        2,
        1,
        2,
        0,
    )


def test_an_engine_without_slots_refuses_an_adapter_naming_it() -> None:
    engine = EchoEngine(CONTEXT)
    with pytest.raises(ConfigError, match=r"adapter='a'.*max_loras"):
        engine.add_request(request("r1", "a"))
    assert engine.adapters() is None


@pytest.mark.parametrize("bad", [5, "x" * (MAX_ADAPTER_NAME + 1), "tab\there"])
def test_a_bad_adapter_name_is_explained(bad: object) -> None:
    why = check_adapter_name(bad)
    assert why is not None and why.startswith("adapter=")


def test_the_reporter_sends_only_changes_and_everything_again_for_a_new_coordinator() -> None:
    engine = EchoEngine(CONTEXT, max_loras=2)
    sent: list[AdapterReport] = []
    reporter = AdapterReporter(engine, 0, lambda msg: sent.append(msg) or True, gap_s=1.0)
    reporter.maybe_send(0.0)
    reporter.maybe_send(5.0)
    assert len(sent) == 1, "nothing changed"
    engine.add_request(request("r1", "a"))
    reporter.maybe_send(5.5)
    assert len(sent) == 1, "within the interval"
    reporter.maybe_send(6.0)
    assert len(sent) == 2 and sent[-1].state.requests == 1
    reporter.send_again(6.1)
    assert len(sent) == 3 and sent[-1].state == sent[-2].state


def test_a_refused_send_is_sent_again_next_interval() -> None:
    engine = EchoEngine(CONTEXT, max_loras=2)
    sent: list[AdapterReport] = []
    accept = [False]
    reporter = AdapterReporter(engine, 0, lambda msg: sent.append(msg) or accept[0], gap_s=1.0)
    reporter.maybe_send(0.0)
    accept[0] = True
    reporter.maybe_send(1.0)
    assert len(sent) == 2


def test_the_coordinator_publishes_each_ranks_adapters_and_forgets_a_dead_ones() -> None:
    state = CoordinatorState(2)
    assert snapshot(state, 1, 0.0).adapters == [], "nothing while no rank reports adapters"
    wire = encode(AdapterReport(rank=1, state=AdapterState(["a"], 2, 1, 0, 3, 2)))
    state.handle(coordinator_decoder(wire))
    snap = snapshot(state, 2, 0.0)
    assert snap.adapters[1].resident == ["a"] and snap.adapters[0] == AdapterState()
    assert describe(state).adapters[1].hits == 2
    state.handle(EngineDead(rank=1, cause=DeathCause.KILLED.value))
    assert snapshot(state, 3, 0.0).adapters == []


def test_a_report_for_a_rank_that_does_not_exist_is_dropped() -> None:
    state = CoordinatorState(1)
    state.handle(AdapterReport(rank=5, state=AdapterState(["a"], 1)))
    assert snapshot(state, 1, 0.0).adapters == [] and state.rejected == 1


def test_a_report_naming_too_long_an_adapter_does_not_decode() -> None:
    body = msgspec.msgpack.encode([16, 0, [["x" * (MAX_ADAPTER_NAME + 1)], 1]])
    with pytest.raises(Exception, match="length"):
        coordinator_decoder(body)


def test_a_snapshot_carries_the_adapters_paths_once_not_once_per_rank() -> None:
    state = CoordinatorState(2)
    for rank, known in ((0, {"a": "/a"}), (1, {"a": "/a", "b": "/b"})):
        state.handle(AdapterReport(rank=rank, state=AdapterState(["a"], 2, known=known)))
    snap = snapshot(state, 1, 0.0)
    assert snap.adapter_paths == {"a": "/a", "b": "/b"}
    assert all(a.known == {} for a in snap.adapters)
