"""The worker channel and the driver-side executor, over real Unix sockets with workers in threads."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from raydp.config import RaydpConfig
from raydp.engine.executor import WorkerContext
from raydp.errors import ConfigError, DeathCause, ProtocolError, WorkerDeadError, WorkerError
from raydp.local.executor import check_device_count, rank_device_ids
from raydp.wire.transport import IpcDir, SocketOptions
from raydp.workers.channel import (
    STEP,
    STOP,
    ChannelServer,
    Link,
    LinkClosedError,
    Reply,
    UnixLink,
    call_decoder,
    call_encoder,
    connect_worker,
)
from raydp.workers.executor import ChannelExecutor

pytestmark = pytest.mark.timeout(30)
Behaviour = Callable[[int, Any], Any]  # (tp_rank, call) -> reply bytes, SILENT, or None to hang up
SILENT = b""  # a follower's answer to a step that went well: nothing


def _echo(tp: int, call: Any) -> bytes:
    if call.method == "boom" or call.args == "boom":
        return call_encoder.encode(Reply(call.seq, False, "Traceback (most recent call last):\nValueError: boom"))
    if call.kind == STEP:
        return call_encoder.encode(Reply(call.seq, True, call.args)) if tp == 0 else SILENT
    return call_encoder.encode(Reply(call.seq, True, [tp, call.method, call.args, call.kwargs]))


def _serve(link: Link, tp: int, behave: Behaviour, seen: list[Any]) -> None:
    try:
        while True:
            call = call_decoder.decode(link.recv(time.monotonic() + 20, lambda: None))
            seen.append((tp, call.kind))
            if call.kind == STOP:
                return
            reply = behave(tp, call)
            if reply is None:
                return
            if reply != SILENT:
                link.send(reply)
    except (LinkClosedError, TimeoutError):
        pass
    finally:
        link.close()


class _Fixture:
    def __init__(self, tmp: IpcDir, world_size: int, behave: Behaviour) -> None:
        self.server = ChannelServer(tmp, SocketOptions(max_message_bytes=1 << 20), remote=False, ctx=None)
        self.seen: list[Any] = []
        self.threads = []
        for tp in range(world_size):
            link = connect_worker(self.server.addresses, tp, True, None, 1 << 20)
            thread = threading.Thread(target=_serve, args=(link, tp, behave, self.seen), daemon=True)
            thread.start()
            self.threads.append(thread)
        contexts = [WorkerContext(3, tp, world_size, "node-a") for tp in range(world_size)]
        self.deaths: list[WorkerDeadError] = []
        self.executor = ChannelExecutor(contexts, on_death=self.deaths.append)
        self.executor.links = self.server.accept(world_size, 5.0, lambda: None)


@pytest.fixture
def ipc_dir() -> Iterator[IpcDir]:
    d = IpcDir("unit-channel")
    yield d
    d.remove()


def test_a_step_reaches_every_worker_and_returns_the_drivers_output(ipc_dir: IpcDir) -> None:
    f = _Fixture(ipc_dir, 3, _echo)
    step = {"decode": [[i, 17] for i in range(8)], "new": [], "free": []}
    assert f.executor.execute_step(step) == step
    assert f.executor.collective_rpc("load", [1], {"a": 2}) == [[tp, "load", [1], {"a": 2}] for tp in range(3)]
    # Only the driver answers a step; a follower's next answer shows it took the step first (one FIFO each).
    assert sorted(tp for tp, kind in f.seen if kind == STEP) == [0, 1, 2]
    assert f.executor.collective_rpc("load", driver_only=True) == [[0, "load", [], {}]]
    f.executor.close()
    for thread in f.threads:
        thread.join(timeout=5)
    assert sorted(tp for tp, kind in f.seen if kind == STOP) == [0, 1, 2], "close asks every worker to stop"


def test_a_workers_exception_names_it_and_carries_its_traceback_and_the_channel_goes_on(ipc_dir: IpcDir) -> None:
    f = _Fixture(ipc_dir, 2, _echo)
    with pytest.raises(WorkerError) as info:
        f.executor.collective_rpc("boom")
    err = info.value
    assert (err.dp_rank, err.tp_rank, err.method) == (3, 0, "boom")
    assert "worker tp0 of rank 3 on node node-a raised in boom: ValueError: boom" in str(err)
    assert "Traceback (most recent call last)" in err.traceback
    assert f.executor.execute_step(5) == 5, "an exception in a call leaves the channel in step"
    f.executor.close()


def test_a_worker_that_hangs_up_is_dead_and_the_rank_is_told_once(ipc_dir: IpcDir) -> None:
    def hang_up_on_step(tp: int, call: Any) -> bytes | None:
        return None if tp == 1 and call.kind == STEP else _echo(tp, call)

    f = _Fixture(ipc_dir, 2, hang_up_on_step)
    assert f.executor.execute_step(1) == 1, "the driver answered; the follower's hang-up shows on the next call"
    assert wait_for(f.executor.links[1].ready)
    with pytest.raises(WorkerDeadError) as info:  # at once: a hang-up is a death, not a wait for a reply
        f.executor.execute_step(2)
    assert (info.value.dp_rank, info.value.tp_rank, info.value.cause) == (3, 1, DeathCause.PROCESS_DIED)
    assert [d.tp_rank for d in f.deaths] == [1]
    with pytest.raises(WorkerDeadError):
        f.executor.execute_step(3)
    with pytest.raises(WorkerDeadError):
        f.executor.check_health()
    assert len(f.deaths) == 1
    f.executor.close()


def test_a_death_reported_by_the_backend_unblocks_a_waiting_step_within_a_poll_slice(ipc_dir: IpcDir) -> None:
    release, answered = threading.Event(), threading.Event()

    def slow(tp: int, call: Any) -> bytes:
        release.wait(30)
        answered.set()
        return _echo(tp, call)

    f = _Fixture(ipc_dir, 2, slow)
    threading.Timer(0.2, lambda: f.executor.mark_dead(1, DeathCause.KILLED, "ray.kill")).start()
    with pytest.raises(WorkerDeadError, match="worker tp1 of rank 3 on node node-a died: killed"):
        f.executor.execute_step(1)
    assert not answered.is_set(), "the death ended the wait; no worker had answered"
    release.set()
    f.executor.close()


@pytest.mark.parametrize("liar", [0, 1])
def test_a_malformed_reply_breaks_the_channel_for_good(ipc_dir: IpcDir, liar: int) -> None:
    def garbage(tp: int, call: Any) -> bytes:
        return b"\xc1not msgpack" if tp == liar else _echo(tp, call)

    f = _Fixture(ipc_dir, 2, garbage)
    with pytest.raises(ProtocolError, match=f"worker tp{liar} of rank 3 sent a malformed reply"):
        f.executor.execute_step(1)
        assert wait_for(f.executor.links[1].ready)
        f.executor.execute_step(2)  # a follower's garbage shows on the next call
    with pytest.raises(ProtocolError):
        f.executor.execute_step(3)
    f.executor.close()


def test_a_follower_that_raises_in_a_step_is_reported_with_its_traceback(ipc_dir: IpcDir) -> None:
    def follower_fails(tp: int, call: Any) -> bytes:
        if tp == 1 and call.kind == STEP:
            return call_encoder.encode(Reply(call.seq, False, "Traceback (most recent call last):\nKeyError: 7"))
        return _echo(tp, call)

    f = _Fixture(ipc_dir, 2, follower_fails)
    f.executor.execute_step(1)
    assert wait_for(f.executor.links[1].ready)
    with pytest.raises(WorkerError, match="worker tp1 of rank 3 on node node-a raised in execute_step: KeyError: 7"):
        f.executor.execute_step(2)
    f.executor.close()


def test_a_followers_failure_ends_a_wait_on_a_driver_that_cannot_answer(ipc_dir: IpcDir) -> None:
    release, driver_answered = threading.Event(), threading.Event()

    def stuck_driver(tp: int, call: Any) -> bytes:
        if call.kind == STEP and tp == 0:
            release.wait(30)  # as a driver waits in a collective its failed peer never joins
            driver_answered.set()
        if call.kind == STEP and tp == 1:
            return call_encoder.encode(Reply(call.seq, False, "Traceback (most recent call last):\nOSError: x"))
        return _echo(tp, call)

    f = _Fixture(ipc_dir, 2, stuck_driver)
    with pytest.raises(WorkerError, match="worker tp1 of rank 3"):
        f.executor.execute_step(1)
    assert not driver_answered.is_set(), "the follower's failure ended the wait; the driver never answered"
    release.set()
    f.executor.close()


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_a_call_past_its_timeout_raises_and_the_channel_is_not_reused(ipc_dir: IpcDir) -> None:
    def never(tp: int, call: Any) -> bytes:
        time.sleep(1.0)
        return _echo(tp, call)

    f = _Fixture(ipc_dir, 1, never)
    with pytest.raises(TimeoutError):
        f.executor.collective_rpc("load", timeout_s=0.2)
    with pytest.raises(ProtocolError, match="did not answer in time"):
        f.executor.collective_rpc("load")
    f.executor.close()


def test_unix_frames_survive_partial_reads_and_oversized_ones_are_refused(tmp_path: Path) -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    sender, receiver = UnixLink(a, 1 << 20), UnixLink(b, 1 << 20)
    big = bytes(range(256)) * 2000  # 512 KB: more than the socket buffer, many reads
    writer = threading.Thread(target=lambda: (sender.send(big), sender.send(b"small")))
    writer.start()
    assert receiver.recv(time.monotonic() + 5, lambda: None) == big
    assert receiver.recv(time.monotonic() + 5, lambda: None) == b"small"
    writer.join(timeout=5)
    small = UnixLink(b, 1000)
    sender.send(b"x" * 2000)
    with pytest.raises(ProtocolError, match="exceeds max_message_bytes=1000"):
        small.recv(time.monotonic() + 5, lambda: None)
    sender.close()
    with pytest.raises(LinkClosedError):
        receiver.recv(time.monotonic() + 5, lambda: None)


def test_the_device_count_check_names_both_numbers() -> None:
    with pytest.raises(ConfigError, match="world_size=4 needs 4 CUDA devices; this machine has 2"):
        check_device_count("GPU", 4, "world_size=4", have=2)
    check_device_count("GPU", 2, "world_size=2", have=2)
    check_device_count("CPU", 64, "world_size=64", have=0)  # CPU workers need no device


def test_local_ranks_take_consecutive_devices_of_their_own() -> None:
    config = RaydpConfig(dp_size=3, tensor_parallel_size=2)
    assert [rank_device_ids(config, r) for r in range(3)] == [("0", "1"), ("2", "3"), ("4", "5")]
    assert rank_device_ids(RaydpConfig(dp_size=4), 3) == ("3",)
    pools = RaydpConfig(prefill_dp_size=1, decode_dp_size=2, prefill_tensor_parallel_size=2)
    ids = [rank_device_ids(pools, r) for r in range(3)]
    assert ids == [("0", "1"), ("2",), ("3",)], "a prefill rank of 2 devices, then decode ranks of 1"
    assert pools.devices_before(3) == 4
