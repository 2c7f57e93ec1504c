"""CoordinatorLoop's lifecycle over real IPC sockets: close() never pulls a socket out from under run()."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import zmq

from raydp.coordinator.loop import CoordinatorLoop
from raydp.coordinator.state import CoordinatorState
from raydp.wire.codec import encode
from raydp.wire.control import BROADCAST_TOPIC, EngineDead, EngineStats, Shutdown, engine_broadcast_decoder
from raydp.wire.records import CoordinatorStatus
from raydp.wire.transport import SocketOptions


@pytest.fixture
def loop() -> Iterator[CoordinatorLoop]:
    coordinator = CoordinatorLoop(
        CoordinatorState(4, stats_interval_s=0.01, heartbeat_interval_s=0.05),
        SocketOptions(high_water_mark=1000, max_message_bytes=1 << 20),
        transport="ipc",
        node_id="n0",
        ipc_prefix=f"test-coord-{uuid.uuid4().hex[:8]}",
    )
    yield coordinator
    coordinator.close()


def run_in_thread(loop: CoordinatorLoop) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def target() -> None:
        try:
            loop.run()
        except BaseException as exc:  # the test asserts there are none
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, errors


@pytest.mark.timeout(30)
def test_close_while_running_waits_for_run_to_close_its_sockets(loop: CoordinatorLoop) -> None:
    from raydp.wire.control import presence_topic

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    engine = ctx.socket(zmq.SUB)
    engine.setsockopt(zmq.SUBSCRIBE, BROADCAST_TOPIC)
    engine.setsockopt(zmq.SUBSCRIBE, presence_topic(0))  # as an engine does: its presence shows it subscribed
    engine.connect(loop.endpoints.broadcast[0])
    push = ctx.socket(zmq.PUSH)
    push.connect(loop.endpoints.collect[0])
    thread, errors = run_in_thread(loop)
    try:
        for i in range(200):  # keep run() busy with real traffic while close() comes in
            push.send(encode(EngineStats(rank=i % 4, waiting=i, running=1)))
        # Subscriptions arrive in order: once the presence is in, so is the broadcast one, and the
        # Shutdown that close() publishes cannot be dropped for want of a subscriber.
        assert loop.wait_for_rank(0, 10)
        loop.close()
        assert not thread.is_alive()  # close() returned only after run() had finished
        assert errors == []
        assert engine.poll(2000), "engines were not told to leave"
        topic, body = engine.recv_multipart()
        assert topic == BROADCAST_TOPIC
        assert isinstance(engine_broadcast_decoder(body), Shutdown)
    finally:
        ctx.destroy(linger=0)


@pytest.mark.timeout(30)
def test_close_before_run_tears_down_and_a_later_run_returns_at_once(loop: CoordinatorLoop) -> None:
    directory = loop.ipc_dir.path if loop.ipc_dir is not None else None
    loop.close()
    assert loop.ctx.closed
    assert directory is not None and not directory.exists()
    thread, errors = run_in_thread(loop)
    thread.join(timeout=5)
    assert not thread.is_alive() and errors == []


@pytest.mark.timeout(30)
def test_describe_from_other_threads_sees_consistent_state_while_the_loop_writes(loop: CoordinatorLoop) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(loop.endpoints.collect[0])
    _, errors = run_in_thread(loop)
    seen: list[CoordinatorStatus] = []
    failures: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        while not stop.is_set():
            try:
                seen.append(loop.describe())
            except BaseException as exc:
                failures.append(exc)

    readers = [threading.Thread(target=reader, daemon=True) for _ in range(2)]
    for r in readers:
        r.start()
    try:
        for i in range(2000):
            push.send(
                encode(
                    EngineDead(rank=i % 4, cause="killed")
                    if i % 7 == 0
                    else EngineStats(rank=i % 4, waiting=i, running=1)
                )
            )
        deadline = time.monotonic() + 10
        while loop.describe().counts[3][0] < 1999 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        for r in readers:
            r.join(timeout=5)
        loop.close()
        ctx.destroy(linger=0)
    assert failures == [] and errors == []
    assert seen and all(len(d.counts) == 4 for d in seen)
    assert loop.describe().counts[3] == [1999, 1]


@pytest.mark.timeout(30)
def test_wait_for_rank_follows_that_ranks_subscription_whatever_its_peers_do(loop: CoordinatorLoop) -> None:
    from raydp.wire.control import presence_topic

    thread, errors = run_in_thread(loop)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        engine = ctx.socket(zmq.SUB)  # rank 2 subscribes, as an engine does; ranks 0, 1, 3 never do
        engine.setsockopt(zmq.SUBSCRIBE, BROADCAST_TOPIC)
        engine.setsockopt(zmq.SUBSCRIBE, presence_topic(2))
        engine.connect(loop.endpoints.broadcast[0])
        assert loop.wait_for_rank(2, 10)
        assert not loop.wait_for_rank(1, 0.2) and not loop.wait_for_engines(4, 0.2)
        engine.close(linger=0)  # gone: unsubscribed
        deadline = time.monotonic() + 10
        while 2 in loop.describe().subscribed and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not loop.wait_for_rank(2, 0.2)
    finally:
        ctx.destroy(linger=0)
        loop.close()
        thread.join(10)
    assert errors == []


@pytest.mark.timeout(30)
def test_a_flood_is_taken_in_bounded_batches_so_snapshots_and_stop_are_looked_at_between(
    loop: CoordinatorLoop,
) -> None:
    from raydp.coordinator import loop as loop_module

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        push = ctx.socket(zmq.PUSH)
        push.connect(loop.endpoints.collect[0])
        total = 2 * loop_module._BATCH + 88
        for i in range(total):
            push.send(encode(EngineStats(rank=i % 4, waiting=0, running=i + 1)))
        batches: list[int] = []
        deadline = time.monotonic() + 20
        while sum(batches) < total and time.monotonic() < deadline:  # however the flood trickles in
            if loop.collect.poll(10):
                batches.append(loop._take_batch())
        assert sum(batches) == total, f"took {sum(batches)} of {total}"
        assert max(batches) <= loop_module._BATCH, f"a batch over the bound: {batches}"
        assert len([b for b in batches if b]) >= 3, "more than two batches' worth takes three turns at least"
        assert [c[1] for c in loop.describe().counts] == [total - 3 + r for r in range(4)]
    finally:
        ctx.destroy(linger=0)


@pytest.mark.timeout(30)
def test_the_status_says_how_long_each_rank_has_been_silent(loop: CoordinatorLoop) -> None:
    """Only a rank's own words count (not a client's FirstRequest naming it); a death starts it afresh."""
    from raydp.wire.control import FirstRequest

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        push = ctx.socket(zmq.PUSH)
        push.connect(loop.endpoints.collect[0])
        for msg in (EngineStats(rank=0, waiting=0, running=0), EngineStats(rank=1, waiting=0, running=0)):
            push.send(encode(msg))
        took = 0
        while took < 2:
            assert loop.collect.poll(10_000), "the rank's words arrive"
            took += loop._take_batch()
        time.sleep(0.3)
        push.send(encode(EngineStats(rank=1, waiting=1, running=0)))
        push.send(encode(FirstRequest(rank=0, wave=0)))  # a client's message, about rank 0
        push.send(encode(EngineDead(rank=3, cause="killed")))
        while took < 5:
            assert loop.collect.poll(10_000)
            took += loop._take_batch()
        silent = loop.describe().silent_s
        assert silent[0] - silent[1] >= 0.3, f"rank 1 spoke 0.3 s after rank 0's last word: {silent}"
        assert silent[2:] == [0.0, 0.0], "ranks that never spoke are not silent"
    finally:
        ctx.destroy(linger=0)
