"""The engine loop over real (inproc) ZMQ sockets, with a real EchoEngine: no Ray."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import zmq

from raydp.engine.core import EngineContext
from raydp.engine.loop import EngineLoop
from raydp.engine.sockets import EngineSockets
from raydp.models.echo import EchoEngine
from raydp.wire.codec import encode
from raydp.wire.control import (
    BROADCAST_TOPIC,
    CacheReport,
    EngineStats,
    SendCache,
    Shutdown,
    coordinator_decoder,
    presence_topic,
)
from raydp.wire.protocol import Abort, OutputBatch, Request, RequestBatch, RequestType, UtilityCall, output_decoder
from raydp.wire.transport import SocketOptions, make_socket
from tests.unit.loop_thread import run_loop

OPTS = SocketOptions()


class FailingAtSecondEngine(EchoEngine):
    """Steps normally until it holds a second request, then every step raises."""

    fail_at = 2

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.added = 0

    def add_request(self, request: Any) -> None:
        super().add_request(request)
        self.added += 1

    def step(self) -> list[Any]:
        if self.added >= self.fail_at:
            raise RuntimeError("device fell off the bus")
        return super().step()


@dataclass
class Rig:
    ctx: zmq.Context[zmq.Socket[bytes]]
    loop: EngineLoop
    thread: threading.Thread
    collect: zmq.Socket[bytes]
    broadcast: zmq.Socket[bytes]
    errors: list[BaseException]

    def client(self, name: bytes, address: str = "inproc://input") -> zmq.Socket[bytes]:
        sock = make_socket(self.ctx, zmq.DEALER, OPTS, identity=name)
        sock.connect(address)
        return sock

    def stop(self) -> None:
        self.broadcast.send_multipart([BROADCAST_TOPIC, encode(Shutdown())])
        self.thread.join(timeout=5)


def start(
    engine: EchoEngine, input_opts: SocketOptions = OPTS, input_count: int = 1, stats_interval_s: float = 0.01
) -> Rig:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    collect = make_socket(ctx, zmq.PULL, OPTS)
    collect.bind("inproc://collect")
    broadcast = make_socket(ctx, zmq.XPUB, OPTS)
    broadcast.bind("inproc://broadcast")
    inputs = [make_socket(ctx, zmq.ROUTER, input_opts) for _ in range(input_count)]
    for i, sock in enumerate(inputs):
        sock.bind("inproc://input" + (str(i) if i else ""))
    push = make_socket(ctx, zmq.PUSH, OPTS)
    push.connect("inproc://collect")
    sub = make_socket(ctx, zmq.SUB, OPTS)
    sub.connect("inproc://broadcast")
    sockets = EngineSockets(ctx, inputs, push, sub, rank=0)
    loop = EngineLoop(engine, 0, sockets, stats_interval_s=stats_interval_s)
    thread, errors = run_loop(loop, sockets, broadcast)
    return Rig(ctx, loop, thread, collect, broadcast, errors)


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = start(EchoEngine(EngineContext(0, 0, 1, 1, "n")))
    yield r
    r.stop()
    r.ctx.destroy(linger=0)


def send(sock: zmq.Socket[bytes], tag: RequestType, msg: Any) -> None:
    sock.send_multipart([tag.value, encode(msg)])


def outputs(sock: zmq.Socket[bytes], until_finished: set[str], timeout: float = 5) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    deadline = time.monotonic() + timeout
    while until_finished and time.monotonic() < deadline:
        if not sock.poll(100):
            continue
        batch: OutputBatch = output_decoder(sock.recv())
        for out in batch.outputs:
            got.setdefault(out.request_id, []).extend(out.token_ids)
            if out.finished:
                until_finished.discard(out.request_id)
    assert not until_finished, f"never finished: {until_finished}"
    return got


@pytest.mark.timeout(30)
def test_requests_stream_back_to_their_own_client(rig: Rig) -> None:
    a, b = rig.client(b"ca"), rig.client(b"cb")
    send(a, RequestType.ADD, Request("x", [1, 2], 3))
    send(b, RequestType.ADD, Request("y", [9], 2))
    assert outputs(a, {"x"}) == {"x": [1, 2, 1]}
    assert outputs(b, {"y"}) == {"y": [9, 9]}


@pytest.mark.timeout(30)
def test_a_request_batch_adds_each_of_its_requests(rig: Rig) -> None:
    a = rig.client(b"ca")
    send(a, RequestType.ADD_MANY, RequestBatch([Request("p", [1], 2), Request("q", [2], 1), Request("r", [3], 3)]))
    assert outputs(a, {"p", "q", "r"}) == {"p": [1, 1], "q": [2], "r": [3, 3, 3]}
    assert rig.loop.counters["added"] == 3


@pytest.mark.timeout(30)
def test_every_output_echoes_the_submission_number_of_its_request(rig: Rig) -> None:
    a = rig.client(b"ca")
    send(a, RequestType.ADD, Request("x", [1], 10**6, seq=7))
    send(a, RequestType.ADD, Request("x", [2], 1, seq=8))  # a duplicate: its error answers submission 8
    send(a, RequestType.ADD_MANY, RequestBatch([Request("y", [3], 2, seq=9)]))
    seen: dict[tuple[str, int], int] = {}
    deadline = time.monotonic() + 5
    while len(seen) < 3 and time.monotonic() < deadline:
        if a.poll(100):
            for out in output_decoder(a.recv()).outputs:
                seen[(out.request_id, out.seq)] = seen.get((out.request_id, out.seq), 0) + 1
    assert set(seen) == {("x", 7), ("x", 8), ("y", 9)}


@pytest.mark.timeout(30)
def test_with_two_input_sockets_each_client_is_answered_where_it_wrote() -> None:
    """The CURVE layout: same-node clients on a plain socket, remote ones on a secured one."""
    rig = start(EchoEngine(EngineContext(0, 0, 1, 1, "n")), input_count=2)
    try:
        local, remote = rig.client(b"local"), rig.client(b"remote", "inproc://input1")
        send(remote, RequestType.ADD, Request("r", [4], 3))
        send(local, RequestType.ADD, Request("l", [5], 2))
        assert outputs(remote, {"r"}) == {"r": [4, 4, 4]}
        assert outputs(local, {"l"}) == {"l": [5, 5]}
    finally:
        rig.stop()
        rig.ctx.destroy(linger=0)


@pytest.mark.timeout(30)
def test_load_is_published_to_the_coordinator() -> None:
    rig = start(EchoEngine(EngineContext(0, 0, 1, 1, "n"), step_delay_s=0.002))  # 0.1 s: several updates
    try:
        a = rig.client(b"ca")
        send(a, RequestType.ADD, Request("x", [1], 50))
        seen, work = [], []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (0, 0) not in seen[1:]:  # the first: idle, before the request
            if rig.collect.poll(100):
                msg = coordinator_decoder(rig.collect.recv())
                assert isinstance(msg, EngineStats)
                seen.append((msg.waiting, msg.running))
                work.append(msg.work)
        assert (0, 1) in seen and (0, 0) in seen[1:], seen
        # EchoEngine says how many tokens it has left: at most the 50 asked for, then down to none.
        work = work[1:]
        assert work[-1] == 0 and all(0 <= w <= 50 for w in work) and work == sorted(work, reverse=True), work
    finally:
        rig.stop()
        rig.ctx.destroy(linger=0)


@pytest.mark.timeout(30)
def test_the_load_is_published_at_start_and_when_the_last_request_finishes(monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing else wakes the loop here: an idle poll lasts a minute.
    monkeypatch.setattr("raydp.engine.loop.IDLE_POLL_MS", 60_000)
    # Stats at most every second while busy: the step that finishes the request comes
    # ~0.25 s after the busy state was published, too soon for a routine update.
    rig = start(EchoEngine(EngineContext(0, 0, 1, 1, "n"), step_delay_s=0.05), stats_interval_s=4.0)
    try:
        assert rig.collect.poll(5000), "the idle load, reported before any request"
        assert coordinator_decoder(rig.collect.recv()) == EngineStats(rank=0, waiting=0, running=0, work=0)
        client = rig.client(b"ca")  # kept: a client that goes away has its requests aborted
        send(client, RequestType.ADD, Request("x", [1], 25))
        seen = []
        deadline = time.monotonic() + 10
        while (0, 0) not in seen and time.monotonic() < deadline:
            if rig.collect.poll(100):
                msg = coordinator_decoder(rig.collect.recv())
                assert isinstance(msg, EngineStats)
                seen.append((msg.waiting, msg.running))
        assert seen[0] == (0, 1) and seen[-1] == (0, 0), seen
    finally:
        rig.stop()
        rig.ctx.destroy(linger=0)


@pytest.mark.timeout(30)
def test_only_the_owner_can_abort(rig: Rig) -> None:
    owner, other = rig.client(b"co"), rig.client(b"cx")
    send(owner, RequestType.ADD, Request("r", [5], 10**7))
    assert outputs_until(owner, lambda o: o.request_id == "r" and bool(o.token_ids)), "r is streaming"
    send(other, RequestType.ABORT, Abort(["r"]))
    send(other, RequestType.UTILITY, UtilityCall(1, "stats"))
    # One client's messages are handled in order: the answer means the abort was seen. The owner
    # keeps reading its stream meanwhile, as a real client does: a reader that stops would fall
    # behind by the outbox's limit, at a speed that depends on the machine, and lose "r" for that.
    reply = None
    poller = zmq.Poller()
    poller.register(owner, zmq.POLLIN)
    poller.register(other, zmq.POLLIN)
    deadline = time.monotonic() + 10
    while reply is None and time.monotonic() < deadline:
        for sock, _ in poller.poll(100):
            batch = output_decoder(sock.recv())
            if sock is other:
                reply = batch.utility
    assert reply is not None and reply.error is None
    later = outputs_until(owner, lambda o: o.request_id == "r")
    assert later is not None and not later.finished, "a stranger's abort is ignored"
    send(owner, RequestType.ABORT, Abort(["r"]))
    deadline = time.monotonic() + 5
    while rig.loop.engine.load() != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rig.loop.engine.load() == (0, 0), "the owner's abort stops it"


@pytest.mark.timeout(30)
def test_an_abort_naming_an_id_twice_aborts_it_once_and_the_loop_serves_on(rig: Rig) -> None:
    # Found by the wire fuzzer: the second name of the id crashed the loop (KeyError).
    a = rig.client(b"ca")
    send(a, RequestType.ADD, Request("twice", [5], 10**7))
    assert outputs_until(a, lambda o: o.request_id == "twice" and bool(o.token_ids)), "it is streaming"
    send(a, RequestType.ABORT, Abort(["twice", "twice", "never-sent"]))
    send(a, RequestType.ADD, Request("after", [6], 2))
    assert outputs(a, {"after"})["after"] == [6, 6], "the loop serves on"
    assert rig.loop.engine.load() == (0, 0), "the abort stopped it"


@pytest.mark.timeout(30)
def test_duplicate_ids_and_bad_utilities_fail_alone(rig: Rig) -> None:
    a = rig.client(b"ca")
    send(a, RequestType.ADD, Request("d", [1], 10**6))
    send(a, RequestType.ADD, Request("d", [2], 1))
    errors = []
    for call in (
        UtilityCall(1, "nope"),
        UtilityCall(2, "shutdown"),
        UtilityCall(3, "_running"),
        UtilityCall(4, "describe", [1, 2]),
    ):
        send(a, RequestType.UTILITY, call)
    deadline = time.monotonic() + 5
    dup_error = None
    original: list[int] = []  # what the first "d" (prompt [1]) keeps streaming
    while (len(errors) < 4 or dup_error is None or len(original) < 3) and time.monotonic() < deadline:
        if a.poll(100):
            batch = output_decoder(a.recv())
            if batch.utility is not None:
                errors.append(batch.utility.error)
            for out in batch.outputs:
                if out.error:
                    dup_error = dup_error or out.error
                else:
                    assert not out.finished, "the original request lives on"
                    original.extend(out.token_ids)
    assert dup_error is not None and "duplicate request id 'd'" in dup_error
    assert len(original) >= 3 and set(original) == {1}, "the duplicate neither replaced nor ended the original"
    assert len(errors) == 4, errors
    assert errors[0] is not None and "AttributeError" in errors[0] and "'nope'" in errors[0]
    assert errors[1] is not None and "'shutdown' is not a utility method" in errors[1]
    assert errors[2] is not None and "'_running' is not a utility method" in errors[2]
    assert errors[3] is not None and errors[3].startswith("TypeError")
    send(a, RequestType.UTILITY, UtilityCall(5, "stats"))
    assert a.poll(5000)
    ok = output_decoder(a.recv())
    while ok.utility is None and a.poll(5000):
        ok = output_decoder(a.recv())
    assert ok.utility is not None and ok.utility.error is None and set(ok.utility.result) >= {"steps", "dummy_steps"}


@pytest.mark.timeout(30)
def test_malformed_input_is_dropped_and_the_loop_keeps_serving(rig: Rig) -> None:
    a = rig.client(b"ca")
    a.send_multipart([b"\x07", b"whatever"])
    a.send_multipart([RequestType.ADD.value, b"\xc1"])
    a.send(b"one frame")
    rig.broadcast.send_multipart([BROADCAST_TOPIC, b"garbage"])
    send(a, RequestType.ADD, Request("ok", [4], 1))
    assert outputs(a, {"ok"}) == {"ok": [4]}
    assert rig.thread.is_alive()


@pytest.mark.timeout(30)
def test_a_failing_step_fails_every_request_then_the_loop() -> None:
    rig = start(FailingAtSecondEngine(EngineContext(0, 0, 1, 1, "n")))
    try:
        a, b = rig.client(b"ca"), rig.client(b"cb")
        send(a, RequestType.ADD, Request("first", [1], 10**6))
        assert outputs_until(a, lambda o: bool(o.token_ids)), "steps run while the engine is healthy"
        send(b, RequestType.ADD, Request("second", [2], 5))
        for client, rid in ((a, "first"), (b, "second")):
            last = outputs_until(client, lambda o: o.finished)
            assert last is not None and last.request_id == rid, f"{rid} is failed, not lost"
            assert "device fell off the bus" in (last.error or "")
        rig.thread.join(timeout=5)
        assert rig.errors and "device fell off the bus" in str(rig.errors[0])
    finally:
        rig.ctx.destroy(linger=0)


def outputs_until(sock: zmq.Socket[bytes], done: Any, timeout: float = 5) -> Any:
    """The first output for which ``done(output)`` holds, or None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sock.poll(100):
            for out in output_decoder(sock.recv()).outputs:
                if done(out):
                    return out
    return None


@pytest.mark.timeout(30)
def test_a_slow_client_loses_nothing_and_stalls_nobody() -> None:
    rig = start(EchoEngine(EngineContext(0, 0, 1, 1, "n")), SocketOptions(high_water_mark=2))
    try:
        slow = make_socket(rig.ctx, zmq.DEALER, SocketOptions(high_water_mark=2), identity=b"slow")
        slow.connect("inproc://input")
        fast = rig.client(b"fast")
        send(slow, RequestType.ADD, Request("s", [1], 300))
        time.sleep(0.3)  # the slow client reads nothing: its outputs back up at the engine
        send(fast, RequestType.ADD, Request("f", [2], 5))
        assert outputs(fast, {"f"}) == {"f": [2] * 5}, "other clients are served meanwhile"
        assert outputs(slow, {"s"}, timeout=10) == {"s": [1] * 300}, "every output reaches the slow client"
    finally:
        rig.stop()
        rig.ctx.destroy(linger=0)


def utility_reply(sock: zmq.Socket[bytes], call: UtilityCall) -> Any:
    """Send ``call`` and return its UtilityResult (outputs arriving meanwhile are skipped)."""
    send(sock, RequestType.UTILITY, call)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if sock.poll(100):
            batch = output_decoder(sock.recv())
            if batch.utility is not None and batch.utility.call_id == call.call_id:
                return batch.utility
    raise AssertionError(f"no answer to {call}")


@pytest.mark.timeout(30)
def test_the_loop_counts_requests_and_answers_raydp_counters_itself(rig: Rig) -> None:
    a = rig.client(b"ca")
    assert utility_reply(a, UtilityCall(1, "raydp_counters")).result == {"added": 0, "finished": 0, "aborted": 0}
    send(a, RequestType.ADD, Request("short", [1], 2))
    assert outputs(a, {"short"}) == {"short": [1, 1]}
    send(a, RequestType.ADD, Request("long", [2], 10**7))
    assert outputs_until(a, lambda o: o.request_id == "long"), "long is streaming"
    send(a, RequestType.ABORT, Abort(["long", "never-sent"]))
    # One client's messages are handled in order: the answer comes after the abort.
    reply = utility_reply(a, UtilityCall(2, "raydp_counters"))
    assert reply.error is None and reply.result == {"added": 2, "finished": 1, "aborted": 1}
    assert not hasattr(rig.loop.engine, "raydp_counters"), "the loop answers, not the engine"
    bad = utility_reply(a, UtilityCall(3, "raydp_counters", [1]))
    assert bad.error is not None and bad.error.startswith("TypeError")


@pytest.mark.timeout(30)
def test_a_burst_over_the_input_budget_is_answered_without_another_signal(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop waits on edge-triggered FDs: a socket left with input over its turn's budget
    signals nothing more, so the loop must come back to it, not sleep on it."""
    monkeypatch.setattr("raydp.engine.loop.IDLE_POLL_MS", 60_000)  # nothing else would wake it
    monkeypatch.setattr("raydp.engine.loop.INPUT_BUDGET", 4)
    rig = start(EchoEngine(EngineContext(0, 0, 1, 1, "n")))
    try:
        client = rig.client(b"cb")
        for i in range(24):  # answered with nothing: no send that would make the loop look again
            send(client, RequestType.ABORT, Abort([f"unknown-{i}"]))
        send(client, RequestType.ADD, Request("last", [7], 1))
        assert outputs(client, {"last"}, timeout=10) == {"last": [7]}
    finally:
        rig.stop()
        rig.ctx.destroy(linger=0)


@pytest.mark.timeout(30)
def test_stop_wakes_an_idle_loop_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another thread stops the loop through its doorbell, whatever its idle wait."""
    monkeypatch.setattr("raydp.engine.loop.IDLE_POLL_MS", 60_000)
    rig = start(EchoEngine(EngineContext(0, 0, 1, 1, "n")))
    try:
        rig.loop.stop()
        rig.loop.sockets.ring()
        rig.thread.join(timeout=5)
        assert not rig.thread.is_alive() and rig.errors == []
    finally:
        rig.ctx.destroy(linger=0)


class CountingEngine(EchoEngine):
    """Counts how often the loop asks whether it has unfinished work."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asked = 0

    def has_unfinished(self) -> bool:
        self.asked += 1
        return super().has_unfinished()


@pytest.mark.timeout(30)
def test_a_busy_loop_asks_the_engine_once_per_step() -> None:
    """With near-empty steps, asking again after every poll was a measurable share of a step:
    a turn that took no input goes on from what the last step left."""
    engine = CountingEngine(EngineContext(0, 0, 1, 1, "n"))
    rig = start(engine)
    try:
        client = rig.client(b"cc")
        send(client, RequestType.ADD, Request("long", [1, 2, 3], 5_000))
        got = outputs(client, {"long"}, timeout=20)
        assert len(got["long"]) == 5_000
        steps, asked = engine.steps, engine.asked
        assert steps == 5_000 and asked <= steps + 20, f"asked {asked} times over {steps} steps"
    finally:
        rig.stop()
        rig.ctx.destroy(linger=0)


class SelfFeedingEngine(EchoEngine):
    """Gains a request without any input, as an engine with a thread of its own may."""

    def feed(self, request: Request) -> None:
        self.add_request(request)


@pytest.mark.timeout(30)
def test_work_an_engine_gains_on_its_own_is_stepped_at_the_next_idle_wake(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("raydp.engine.loop.IDLE_POLL_MS", 50)
    engine = SelfFeedingEngine(EngineContext(0, 0, 1, 1, "n"))
    rig = start(engine)
    try:
        engine.feed(Request("own", [4], 3))
        deadline = time.monotonic() + 5
        while engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.has_unfinished() and engine.steps == 3, "the idle loop never stepped it"
    finally:
        rig.stop()
        rig.ctx.destroy(linger=0)


@pytest.mark.timeout(30)
def test_cache_events_go_to_the_coordinator_whole_first_and_whole_again_when_it_asks() -> None:
    rig = start(EchoEngine(EngineContext(0, 0, 1, 1, "n"), prefix_cache_blocks=16, block_size=4))
    try:

        def next_report(timeout: float = 5) -> CacheReport:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if rig.collect.poll(100):
                    msg = coordinator_decoder(rig.collect.recv())
                    if isinstance(msg, CacheReport):
                        return msg
            raise AssertionError("no cache report came")

        first = next_report()  # at start: the whole (empty) cache, which replaces a predecessor's
        assert first.events.full and first.events.stored == [] and first.seq == 1
        a = rig.client(b"ca")
        send(a, RequestType.ADD, Request("x", list(range(8)), 1))
        outputs(a, {"x"})
        delta = next_report()
        assert not delta.events.full and len(delta.events.stored) == 2 and delta.seq == 2
        assert delta.incarnation == first.incarnation and delta.events.queried == 8
        time.sleep(1.0)  # whole reports go at most once a second
        rig.broadcast.send_multipart([presence_topic(0), encode(SendCache())])  # a report of its went missing
        again = next_report()
        assert again.events.full and sorted(again.events.stored) == sorted(delta.events.stored) and again.seq == 3
    finally:
        rig.stop()
        rig.ctx.destroy(linger=0)


@pytest.mark.timeout(30)
def test_an_idle_rank_repeats_its_unchanged_load_so_the_coordinator_hears_it_alive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("raydp.engine.loop.IDLE_POLL_MS", 50)
    monkeypatch.setattr("raydp.engine.loop.ALIVE_EVERY_S", 0.2)
    rig = start(EchoEngine(EngineContext(0, 0, 1, 1, "n")))
    try:
        seen = []
        deadline = time.monotonic() + 20
        while len(seen) < 3 and time.monotonic() < deadline:
            if rig.collect.poll(100):
                seen.append(coordinator_decoder(rig.collect.recv()))
        assert seen == [EngineStats(rank=0, waiting=0, running=0, work=0)] * 3, seen
    finally:
        rig.stop()
        rig.ctx.destroy(linger=0)
