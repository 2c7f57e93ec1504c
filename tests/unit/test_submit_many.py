"""``submit_many`` and the asyncio client's batching, against real sockets standing in for two engines."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from raydp.client.aio import AsyncClient
from raydp.client.client import Client
from raydp.errors import ConfigError
from raydp.wire.codec import encode
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint
from raydp.wire.protocol import Output, OutputBatch, Request, RequestBatch, RequestType, decode_input
from raydp.wire.transport import SocketOptions

pytestmark = pytest.mark.timeout(30)


class Engines:
    """Two ROUTERs that record every input message and can answer a request."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.routers = [self.ctx.socket(zmq.ROUTER) for _ in range(2)]
        self.addresses = [f"tcp://127.0.0.1:{r.bind_to_random_port('tcp://127.0.0.1')}" for r in self.routers]
        self.publish = self.ctx.socket(zmq.PUB)
        self.collect = self.ctx.socket(zmq.PULL)
        self.coord = [
            f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}" for s in (self.publish, self.collect)
        ]

    def endpoints(self) -> ClusterEndpoints:
        engines = [EngineEndpoint(r, "n", [a]) for r, a in enumerate(self.addresses)]
        coord = CoordinatorEndpoints("n", [self.coord[0]], [self.coord[1]], [self.coord[1]])
        return ClusterEndpoints("batch", engines, coord, lockstep=False)

    def messages(self, rank: int, wait_s: float = 2.0) -> list[tuple[bytes, bytes, Any]]:
        """Every input message rank ``rank`` got, as (client, tag, decoded body)."""
        router, got = self.routers[rank], []
        while router.poll(int(wait_s * 1000)):
            client, tag, body = router.recv_multipart()
            got.append((client, tag, decode_input(tag, body)))
            wait_s = 0.2
        return got

    def answer(self, rank: int, client: bytes, request: Request) -> None:
        out = Output(request.request_id, list(request.prompt_token_ids), True, "length", seq=request.seq)
        self.routers[rank].send_multipart([client, encode(OutputBatch(rank, [out]))])

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture
def engines() -> Iterator[Engines]:
    e = Engines()
    yield e
    e.close()


def test_submit_many_sends_one_message_per_rank_and_spreads_the_requests(engines: Engines) -> None:
    client = Client(engines.endpoints(), node_id="n", options=SocketOptions())
    try:
        handles = client.submit_many([[i] for i in range(10)], max_tokens=1)
        per_rank = [engines.messages(r) for r in range(2)]
        for msgs in per_rank:
            assert [tag for _, tag, _ in msgs] == [RequestType.ADD_MANY.value], "one message per rank"
        batches = [msgs[0][2] for msgs in per_rank]
        assert all(isinstance(b, RequestBatch) for b in batches)
        assert sorted(len(b.requests) for b in batches) == [5, 5], "the choices spread over the ranks"
        for rank, msgs in enumerate(per_rank):
            who, _, batch = msgs[0]
            for request in batch.requests:
                engines.answer(rank, who, request)
        assert [h.result(timeout=10) for h in handles] == [[i] for i in range(10)], "handles keep prompt order"
        assert sorted({h.rank for h in handles}) == [0, 1]
    finally:
        client.close()


def test_a_bad_prompt_in_a_batch_names_its_index_and_nothing_is_sent(engines: Engines) -> None:
    client = Client(engines.endpoints(), node_id="n", options=SocketOptions())
    try:
        with pytest.raises(ConfigError, match=r"prompts\[2\]: prompt_token_ids\[0\]=-1"):
            client.submit_many([[1], [2], [-1]], max_tokens=1)
        assert engines.messages(0, 0.3) == [] and engines.messages(1, 0.3) == []
    finally:
        client.close()


def test_the_async_client_batches_requests_made_in_one_loop_turn(engines: Engines) -> None:
    client = Client(engines.endpoints(), node_id="n", options=SocketOptions())

    async def main() -> list[list[int]]:
        aclient = AsyncClient(client)
        requests = [aclient.submit([i], 1) for i in range(6)]  # e.g. six concurrent HTTP requests
        await asyncio.sleep(0)
        per_rank = await asyncio.to_thread(lambda: [engines.messages(r) for r in range(2)])
        assert [[tag for _, tag, _ in msgs] for msgs in per_rank] == [[RequestType.ADD_MANY.value]] * 2
        for rank, msgs in enumerate(per_rank):
            who, _, batch = msgs[0]
            for request in batch.requests:
                engines.answer(rank, who, request)
        results = []
        for request in requests:
            results.append([t async for chunk in request for t in chunk])
        return results

    try:
        assert asyncio.run(main()) == [[i] for i in range(6)]
    finally:
        client.close()
