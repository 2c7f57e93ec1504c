"""The client's utility calls, against a real engine ROUTER that answers only when told to."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq

from raydp.client.client import Client
from raydp.errors import DeathCause, EngineDeadError
from raydp.wire.codec import encode
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint
from raydp.wire.protocol import OutputBatch, RequestType, UtilityResult, utility_decoder

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def rig() -> Iterator[tuple[Client, zmq.Socket[bytes]]]:
    """A one-rank dense cluster: an engine ROUTER that the test drives, and a coordinator nobody runs."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    engine, collect, publish = ctx.socket(zmq.ROUTER), ctx.socket(zmq.PULL), ctx.socket(zmq.PUB)
    addr = {s: f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}" for s in (engine, collect, publish)}
    endpoints = ClusterEndpoints(
        "calls",
        [EngineEndpoint(0, "n", [addr[engine]])],
        CoordinatorEndpoints("n", [addr[publish]], [addr[collect]], [addr[collect]]),
        lockstep=False,
    )
    client = Client(endpoints, node_id="n", follow_liveness=False)
    yield client, engine
    client.close()
    ctx.destroy(linger=0)


def _pending_calls(client: Client, settle_s: float = 5.0) -> int:
    """The size of the pending-calls table once the IO thread has run what is queued."""
    deadline = time.monotonic() + settle_s
    while client._router.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    return len(client._router.calls)


def _receive_call(engine: zmq.Socket[bytes]) -> tuple[bytes, int]:
    assert engine.poll(5000), "the call reaches the engine"
    identity, tag, body = engine.recv_multipart()
    assert tag == RequestType.UTILITY.value
    return identity, utility_decoder(body).call_id


def test_a_timed_out_call_leaves_no_pending_entry(rig) -> None:  # type: ignore[no-untyped-def]
    client, engine = rig
    with pytest.raises(TimeoutError):
        client.call_utility(0, "never_answered", timeout=0.3)
    identity, call_id = _receive_call(engine)  # it was sent, so it was booked
    assert _pending_calls(client) == 0, "a timed-out call must not stay in the table"
    # A late answer for the forgotten call is ignored, and the client still works.
    engine.send_multipart([identity, encode(OutputBatch(0, utility=UtilityResult(call_id, "late")))])
    with pytest.raises(TimeoutError):
        client.call_utility(0, "answered", timeout=0.01)
    identity, call_id = _receive_call(engine)
    assert _pending_calls(client) == 0


def test_an_answered_call_returns_its_result_and_leaves_no_entry(rig) -> None:  # type: ignore[no-untyped-def]
    client, engine = rig
    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(client.call_utility, 0, "describe", 1, timeout=10)
        identity, call_id = _receive_call(engine)
        engine.send_multipart([identity, encode(OutputBatch(0, utility=UtilityResult(call_id, {"rank": 0})))])
        assert result.result(timeout=10) == {"rank": 0}
    assert _pending_calls(client) == 0


def test_a_call_on_a_rank_that_dies_fails_at_once(rig) -> None:  # type: ignore[no-untyped-def]
    client, engine = rig
    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(client.call_utility, 0, "stats", timeout=20)
        _receive_call(engine)
        client.mark_dead(EngineDeadError(0, "n", DeathCause.KILLED, "test"))
        with pytest.raises(EngineDeadError):
            result.result(timeout=5)  # not after the call's own 20 s timeout
    assert _pending_calls(client) == 0
