"""Two more rows for the round-trip table: raydp's ``submit_many``, and the pipe it is measured against.

* ``submit_many``: the DP=2 cluster of the first row, fed in batches of
  ``window`` requests (one hand-off to the IO thread and one message per rank
  per batch), two batches in flight;
* the second floor: a single PUSH/PULL pipe with msgspec to one echo process,
  ``window`` requests in flight; the fastest a Python client and server can
  move these messages, with no routing, no per-client replies, no engine loop.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import shutil
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from benchmarks.common import PROMPT, TIMEOUT_S
from benchmarks.roundtrip.targets import EchoTarget, echo_reply, encoded_request

STOP = b"\xff"


def pipe_echo_server(requests: str, replies: str) -> None:
    """PULL a request, PUSH its reply (runs in a spawned process)."""
    import zmq

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (pull, push):
        sock.setsockopt(zmq.LINGER, 0)
    pull.bind(requests)
    push.bind(replies)
    try:
        while (body := pull.recv()) != STOP:
            push.send(echo_reply(0, body))
    finally:
        ctx.destroy(linger=0)


class PipeTarget:
    """Replies come back in order on one pipe: waiting for a request is reading one reply."""

    def __init__(self, requests: str, replies: str) -> None:
        import zmq

        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.push, self.pull = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        for sock in (self.push, self.pull):
            sock.setsockopt(zmq.LINGER, 0)
        self.push.connect(requests)
        self.pull.connect(replies)
        self.pull.setsockopt(zmq.RCVTIMEO, int(TIMEOUT_S * 1000))

    def send(self, i: int) -> Any:
        self.push.send(encoded_request(i))
        return i

    def wait(self, token: Any) -> None:
        from raydp.wire.protocol import output_decoder

        output_decoder(self.pull.recv())

    def close(self) -> None:
        self.push.send(STOP)
        time.sleep(0.1)
        self.ctx.destroy(linger=0)


@contextlib.contextmanager
def pipe_target() -> Iterator[EchoTarget]:
    spawn = multiprocessing.get_context("spawn")
    ipc_dir = tempfile.mkdtemp(prefix="raydp-bench-pipe-")
    requests, replies = f"ipc://{ipc_dir}/requests", f"ipc://{ipc_dir}/replies"
    server = spawn.Process(target=pipe_echo_server, args=(requests, replies), daemon=True)
    server.start()
    target = PipeTarget(requests, replies)
    try:
        yield target
    finally:
        target.close()
        server.join(timeout=5)
        if server.is_alive():
            server.terminate()
        shutil.rmtree(ipc_dir, ignore_errors=True)


class ManyRunner:
    """``submit_many`` batches of ``window`` requests, two batches in flight; pipelined only."""

    def __init__(self, client: Any, window: int) -> None:
        self.client, self.batch = client, [PROMPT] * window
        self.pipelined(0)  # warm up

    def pipelined(self, seconds: float) -> float:
        inflight: deque[list[Any]] = deque()
        batches = 0
        start = time.perf_counter()
        while batches < 2 or time.perf_counter() - start < seconds:
            batches += 1
            if len(inflight) >= 2:
                for handle in inflight.popleft():
                    handle.result(TIMEOUT_S)
            inflight.append(self.client.submit_many(self.batch, 1))
        while inflight:
            for handle in inflight.popleft():
                handle.result(TIMEOUT_S)
        return batches * len(self.batch) / (time.perf_counter() - start)

    def sequential(self, n: int) -> list[float]:
        return []  # batches only
