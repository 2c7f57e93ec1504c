"""The client's threads taking turns on its sockets: callers sending inline, the IO thread
sending queued bursts and reading, against a real echo engine on a real socket."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import zmq

from raydp.client.client import Client
from raydp.client.requests import RequestHandle
from raydp.client.turns import INLINE_MAX_IN_FLIGHT
from raydp.errors import DeathCause, EngineDeadError
from raydp.wire.codec import encode
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint
from raydp.wire.protocol import Abort, Output, OutputBatch, Request, RequestBatch, decode_input
from raydp.wire.transport import SocketOptions

pytestmark = pytest.mark.timeout(60)


class EchoEngines:
    """ROUTERs on a thread of their own answering each request with its prompt (or holding them)."""

    def __init__(self, ranks: int = 2, answer: bool = True) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.routers = [self.ctx.socket(zmq.ROUTER) for _ in range(ranks)]
        self.addresses = [f"tcp://127.0.0.1:{r.bind_to_random_port('tcp://127.0.0.1')}" for r in self.routers]
        self.publish, self.collect = self.ctx.socket(zmq.PUB), self.ctx.socket(zmq.PULL)
        self.coord = [
            f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}" for s in (self.publish, self.collect)
        ]
        self.answer, self.seen = answer, [list[tuple[bytes, object]]() for _ in range(ranks)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def endpoints(self) -> ClusterEndpoints:
        engines = [EngineEndpoint(r, "n", [a]) for r, a in enumerate(self.addresses)]
        coord = CoordinatorEndpoints("n", [self.coord[0]], [self.coord[1]], [self.coord[1]])
        return ClusterEndpoints("threads", engines, coord, lockstep=False)

    def _serve(self) -> None:
        poller = zmq.Poller()
        for router in self.routers:
            poller.register(router, zmq.POLLIN)
        while not self._stop.is_set():
            for router, _ in poller.poll(50):
                rank = self.routers.index(router)  # type: ignore[arg-type]
                who, tag, body = router.recv_multipart()  # type: ignore[union-attr]
                msg = decode_input(tag, body)
                self.seen[rank].append((tag, msg))
                requests = msg.requests if isinstance(msg, RequestBatch) else [msg] if isinstance(msg, Request) else []
                if self.answer and requests:
                    outs = [Output(r.request_id, list(r.prompt_token_ids), True, "length", seq=r.seq) for r in requests]
                    router.send_multipart([who, encode(OutputBatch(rank, outs))])  # type: ignore[union-attr]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.ctx.destroy(linger=0)


def events(msg: object) -> list[tuple[str, str]]:
    """What an input message does, request by request: ("add" | "abort", request id)."""
    if isinstance(msg, Request):
        return [("add", msg.request_id)]
    if isinstance(msg, RequestBatch):
        return [("add", r.request_id) for r in msg.requests]
    if isinstance(msg, Abort):
        return [("abort", rid) for rid in msg.request_ids]
    return []


def request_ids(seen: list[tuple[bytes, object]]) -> list[str]:
    return [rid for _, msg in seen for what, rid in events(msg) if what == "add"]


@pytest.fixture
def echo() -> Iterator[EchoEngines]:
    engines = EchoEngines()
    yield engines
    engines.close()


def test_callers_one_at_a_time_and_in_bursts_each_get_their_own_answer(echo: EchoEngines) -> None:
    """Sequential callers send inline; a pipelined caller's requests queue for the IO thread:
    both at once, and every answer reaches the request that asked for it."""
    client = Client(echo.endpoints(), node_id="n", options=SocketOptions())
    errors: list[BaseException] = []

    def one_at_a_time(t: int) -> None:
        try:
            for i in range(300):
                assert client.generate([t, i], max_tokens=2, timeout=10) == [t, i]
        except BaseException as exc:
            errors.append(exc)

    def pipelined() -> None:
        try:
            handles = [(i, client.submit([99, i], 2)) for i in range(2000)]
            assert all(h.result(10) == [99, i] for i, h in handles)
        except BaseException as exc:
            errors.append(exc)

    try:
        threads = [threading.Thread(target=one_at_a_time, args=(t,)) for t in range(4)]
        threads.append(threading.Thread(target=pipelined))
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=50)
        assert not any(t.is_alive() for t in threads), "a caller hung: an answer was stranded"
        assert errors == []
        sent = [rid for seen in echo.seen for rid in request_ids(seen)]
        assert len(sent) == len(set(sent)) == 4 * 300 + 2000, "each request reached an engine exactly once"
    finally:
        client.close()


def test_an_abort_queued_behind_its_submit_reaches_the_engine_after_it() -> None:
    """Under load, commands queue for the IO thread (queued submits leave together, one message
    per rank); a caller's abort never overtakes its submit."""
    engines = EchoEngines(ranks=1, answer=False)
    client = Client(engines.endpoints(), node_id="n", options=SocketOptions())
    try:
        handles = [client.submit([i], 4) for i in range(INLINE_MAX_IN_FLIGHT + 50)]  # the later ones queue
        for h in handles:
            client.abort(h.request_id)
        assert all(h.result(10) == [] and h.finish_reason == "abort" for h in handles)
        order: list[tuple[str, str]] = []
        for _ in range(100):
            order = [event for _, msg in engines.seen[0] for event in events(msg)]
            if len(order) == 2 * len(handles):
                break
            threading.Event().wait(0.05)
        for h in handles:
            assert order.index(("add", h.request_id)) < order.index(("abort", h.request_id))
    finally:
        client.close()
        engines.close()


def test_every_thread_waiting_on_one_result_wakes() -> None:
    handle = RequestHandle("r")
    got: list[list[int]] = []
    waiters = [threading.Thread(target=lambda: got.append(handle.result(10))) for _ in range(5)]
    for t in waiters:
        t.start()
    handle.deliver(Output("r", [7], True, "length"))
    for t in waiters:
        t.join(timeout=10)
    assert got == [[7]] * 5


def test_a_caller_reading_for_its_own_answer_learns_of_a_death_or_abort_from_another_thread() -> None:
    """The waiting caller polls the engine sockets itself; what another thread decides for its
    request (the rank died, the request was aborted) still reaches it."""
    engines = EchoEngines(ranks=2, answer=False)
    client = Client(engines.endpoints(), node_id="n", options=SocketOptions())
    try:
        doomed, aborted = client.submit([1], 4, rank=0), client.submit([2], 4, rank=1)
        threading.Timer(0.3, lambda: client.mark_dead(EngineDeadError(0, "n", DeathCause.KILLED, "test"))).start()
        with pytest.raises(EngineDeadError, match="rank 0"):
            doomed.result(timeout=10)
        threading.Timer(0.3, lambda: client.abort(aborted.request_id)).start()
        assert aborted.result(timeout=10) == [] and aborted.finish_reason == "abort"
    finally:
        client.close()
        engines.close()


def test_submissions_queued_under_load_leave_as_one_message_per_rank() -> None:
    """With a few requests in flight, what callers submit while the IO thread is busy goes out
    together: one RequestBatch per rank, not a message per request."""
    engines = EchoEngines(ranks=2, answer=False)
    client = Client(engines.endpoints(), node_id="n", options=SocketOptions())
    try:
        first = [client.submit([i], 4) for i in range(INLINE_MAX_IN_FLIGHT)]  # sent inline, one message each
        with client._turns.lock:  # the IO thread cannot take a turn: the next submissions queue
            queued = [client.submit([i], 4) for i in range(40)]
        for _ in range(100):
            adds = [sum(len(events(m)) for _, m in seen) for seen in engines.seen]
            if sum(adds) == len(first) + len(queued):
                break
            threading.Event().wait(0.05)
        batches = [m for seen in engines.seen for _, m in seen if isinstance(m, RequestBatch)]
        assert len(batches) == 2, "one message per rank for the queued burst"
        assert sorted(r.request_id for b in batches for r in b.requests) == sorted(h.request_id for h in queued)
    finally:
        client.close()
        engines.close()


def test_a_caller_reading_its_own_answers_leaves_the_io_thread_asleep(
    echo: EchoEngines, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One request at a time, the caller reads its answer itself: the IO thread, with nothing
    else in flight, stays in its quiet poll instead of waking for every output."""
    # A quiet poll of a minute: its own timeouts then count nothing however slowly the 300 requests go.
    monkeypatch.setattr("raydp.client.turns.IDLE_WAIT_MS", 60_000)
    client = Client(echo.endpoints(), node_id="n", options=SocketOptions())
    try:
        assert client.generate([0], 1, timeout=10) == [0]
        waits = {"full": 0, "quiet": 0}
        for kind, poller in (("full", client._io.poll_set), ("quiet", client._io.quiet_set)):

            def counted(timeout_ms: int, wait=poller.wait, kind=kind):  # type: ignore[no-untyped-def]
                waits[kind] += 1
                return wait(timeout_ms)

            poller.wait = counted  # type: ignore[method-assign]
        for i in range(300):
            assert client.generate([1, i], 1, timeout=10) == [1, i]
        # Woken per request, the IO thread would have waited 300 times or more; asleep, a few times
        # (once more for each snapshot it read, none here).
        assert waits["full"] + waits["quiet"] < 50, waits
    finally:
        client.close()


def test_work_nobody_reads_for_wakes_the_quiet_io_thread(echo: EchoEngines, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs no caller reads for itself reach their listeners though the IO thread's quiet
    poll lasts a minute: AsyncClient requests, and callers that find another one reading."""
    import asyncio

    from raydp.client.aio import AsyncClient

    monkeypatch.setattr("raydp.client.turns.IDLE_WAIT_MS", 60_000)
    client = Client(echo.endpoints(), node_id="n", options=SocketOptions())
    try:
        assert client.generate([0], 1, timeout=10) == [0]  # the IO thread is in its quiet poll now

        async def over_asyncio() -> list[list[int]]:
            aio = AsyncClient(client)
            return await asyncio.wait_for(asyncio.gather(*(aio.generate([2, i], 1) for i in range(20))), 5)

        for _ in range(3):  # a ZMQ_FD may signal spuriously and wake the IO thread once: not every time
            assert asyncio.run(over_asyncio()) == [[2, i] for i in range(20)]
            threading.Event().wait(0.2)  # back to its quiet poll
        errors: list[BaseException] = []

        def caller(t: int) -> None:  # at most one caller reads at a time; the others must be told
            try:
                for i in range(100):
                    assert client.generate([t, i], 1, timeout=20) == [t, i]
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=caller, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=50)
        assert not any(t.is_alive() for t in threads) and errors == [], errors
    finally:
        client.close()
