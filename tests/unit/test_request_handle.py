"""RequestHandle: results and streams fed from another (IO) thread."""

from __future__ import annotations

import threading
import time

import pytest

from raydp.client.requests import RequestHandle
from raydp.errors import DeathCause, EngineDeadError, RequestError
from raydp.wire.protocol import Output


def feed(handle: RequestHandle, items: list[Output | EngineDeadError], delay: float = 0.01) -> threading.Thread:
    def run() -> None:
        for item in items:
            time.sleep(delay)
            handle.deliver(item)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.timeout(10)
def test_stream_yields_chunks_as_they_arrive_and_result_has_them_all() -> None:
    h = RequestHandle("r")
    feed(h, [Output("r", [1, 2]), Output("r", []), Output("r", [3]), Output("r", [4], True, "length")])
    assert list(h.stream(timeout=5)) == [[1, 2], [3], [4]]
    assert h.result(timeout=1) == [1, 2, 3, 4]
    assert h.finish_reason == "length" and h.done()


@pytest.mark.timeout(10)
def test_an_engine_error_output_raises_request_error() -> None:
    h = RequestHandle("r")
    feed(h, [Output("r", [1]), Output("r", [], True, "error", "rejected by engine: boom")])
    chunks = []
    with pytest.raises(RequestError, match="boom"):
        for chunk in h.stream(timeout=5):
            chunks.append(chunk)
    assert chunks == [[1]]
    with pytest.raises(RequestError):
        h.result(timeout=1)


@pytest.mark.timeout(10)
def test_a_dead_rank_fails_the_waiters() -> None:
    h = RequestHandle("r")
    feed(h, [Output("r", [7]), EngineDeadError(3, "node-a", DeathCause.KILLED)])
    with pytest.raises(EngineDeadError, match="rank 3"):
        h.result(timeout=5)


@pytest.mark.timeout(10)
def test_timeouts_name_the_request() -> None:
    h = RequestHandle("slow")
    with pytest.raises(TimeoutError, match="'slow'"):
        h.result(timeout=0.05)
    with pytest.raises(TimeoutError, match="'slow'"):
        next(h.stream(timeout=0.05))
