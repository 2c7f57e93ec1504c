"""A client over P/D pools: prefill on a prefill rank, the rest on a decode rank, one stream to the caller.

The ranks are ROUTER sockets the test drives, so each stage's request is read
as the engine would read it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import zmq

from raydp.client.client import Client
from raydp.errors import ConfigError, DeathCause, EngineDeadError, KVTransferError
from raydp.wire.codec import encode
from raydp.wire.control import StatsSnapshot
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint
from raydp.wire.protocol import Output, OutputBatch, Request, RequestType, abort_decoder, request_decoder

pytestmark = pytest.mark.timeout(30)
PROMPT = [3, 1, 4, 1, 5]
Rig = tuple[Client, list[zmq.Socket[bytes]]]


@contextmanager
def cluster_of_four(follow_liveness: bool) -> Iterator[tuple[Client, list[zmq.Socket[bytes]], zmq.Socket[bytes]]]:
    """Ranks 0 and 1 prefill, 2 and 3 decode; a coordinator nobody runs but whose PUB the test holds."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    engines = [ctx.socket(zmq.ROUTER) for _ in range(4)]
    collect, publish = ctx.socket(zmq.PULL), ctx.socket(zmq.PUB)
    addr = {s: f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}" for s in (*engines, collect, publish)}
    endpoints = ClusterEndpoints(
        "pd",
        [EngineEndpoint(r, "n", [addr[e]]) for r, e in enumerate(engines)],
        CoordinatorEndpoints("n", [addr[publish]], [addr[collect]], [addr[collect]]),
        lockstep=False,
        prefill_ranks=2,
    )
    client = Client(endpoints, node_id="n", follow_liveness=follow_liveness)
    try:
        yield client, engines, publish
    finally:
        client.close()
        ctx.destroy(linger=0)


@pytest.fixture
def rig() -> Iterator[Rig]:
    with cluster_of_four(follow_liveness=False) as (client, engines, _):
        yield client, engines


def receive(engines: list[zmq.Socket[bytes]], ranks: range) -> tuple[int, bytes, Request]:
    """The next request that reaches one of ``ranks`` (and none reaches the others)."""
    poller = zmq.Poller()
    for engine in engines:
        poller.register(engine, zmq.POLLIN)
    ready = dict(poller.poll(5000))
    assert ready, "a request reaches a rank"
    rank = next(r for r, e in enumerate(engines) if e in ready)
    assert rank in ranks, f"the request went to rank {rank}, outside its pool {list(ranks)}"
    identity, tag, body = engines[rank].recv_multipart()
    assert tag == RequestType.ADD.value
    return rank, identity, request_decoder(body)


def reply(engines: list[zmq.Socket[bytes]], rank: int, identity: bytes, out: Output) -> None:
    engines[rank].send_multipart([identity, encode(OutputBatch(rank, [out]))])


def test_a_request_prefills_on_a_prefill_rank_and_decodes_on_a_decode_rank(rig: Rig) -> None:
    client, engines = rig
    handle = client.submit(PROMPT, max_tokens=4)
    rank, identity, first = receive(engines, range(2))
    assert (first.prompt_token_ids, first.max_tokens, first.prefill_only) == (PROMPT, 1, True)
    reply(engines, rank, identity, Output(first.request_id, [7], True, "length", seq=first.seq))
    chunks = handle.stream(timeout=10)
    assert next(chunks) == [7]  # the first token streams before the decode rank answers
    rank, identity, rest = receive(engines, range(2, 4))
    assert rest.request_id == first.request_id
    assert (rest.prompt_token_ids, rest.max_tokens) == ([*PROMPT, 7], 3)
    assert rest.prefill_only is False and rest.prefilled == len(PROMPT)
    reply(engines, rank, identity, Output(rest.request_id, [8, 9, 10], True, "length", seq=rest.seq))
    assert list(chunks) == [[8, 9, 10]]
    assert handle.result(timeout=1) == [7, 8, 9, 10] and handle.finish_reason == "length"


def test_a_first_token_that_ends_the_request_ends_it_on_the_prefill_rank(rig: Rig) -> None:
    client, engines = rig
    handle = client.submit(PROMPT, max_tokens=4)
    rank, identity, first = receive(engines, range(2))
    reply(engines, rank, identity, Output(first.request_id, [2], True, "stop", seq=first.seq))
    assert handle.result(timeout=10) == [2] and handle.finish_reason == "stop"
    assert not any(e.poll(200) for e in engines), "nothing goes to a decode rank"


def test_a_one_token_request_is_all_prefill(rig: Rig) -> None:
    client, engines = rig
    handle = client.submit(PROMPT, max_tokens=1)
    rank, identity, only = receive(engines, range(2))
    assert only.prefill_only is False and only.max_tokens == 1
    reply(engines, rank, identity, Output(only.request_id, [6], True, "length", seq=only.seq))
    assert handle.result(timeout=10) == [6]


def test_a_prefill_rank_that_dies_mid_prefill_sends_the_request_to_the_other(rig: Rig) -> None:
    client, engines = rig
    handle = client.submit(PROMPT, max_tokens=3)  # not retryable: a prefill has streamed nothing
    dead, _, first = receive(engines, range(2))
    client.mark_dead(EngineDeadError(dead, "n", DeathCause.KILLED, "test"))
    rank, identity, again = receive(engines, range(2))
    assert rank == 1 - dead and again.request_id == first.request_id and again.prefill_only
    reply(engines, rank, identity, Output(again.request_id, [7], True, "length", seq=again.seq))
    rank, identity, rest = receive(engines, range(2, 4))
    reply(engines, rank, identity, Output(rest.request_id, [8, 9], True, "length", seq=rest.seq))
    assert handle.result(timeout=10) == [7, 8, 9]


def test_a_decode_rank_that_dies_mid_stream_moves_the_stream_to_the_other(rig: Rig) -> None:
    client, engines = rig
    handle = client.submit(PROMPT, max_tokens=5, migratable=True)
    rank, identity, first = receive(engines, range(2))
    reply(engines, rank, identity, Output(first.request_id, [7], True, "length", seq=first.seq))
    dead, identity, rest = receive(engines, range(2, 4))
    reply(engines, dead, identity, Output(rest.request_id, [8], seq=rest.seq))
    chunks = handle.stream(timeout=10)
    assert [next(chunks), next(chunks)] == [[7], [8]]
    client.mark_dead(EngineDeadError(dead, "n", DeathCause.KILLED, "test"))
    rank, identity, moved = receive(engines, range(2, 4))
    assert rank == 5 - dead
    assert (moved.prompt_token_ids, moved.max_tokens, moved.prefilled) == ([*PROMPT, 7, 8], 3, len(PROMPT))
    reply(engines, rank, identity, Output(moved.request_id, [9, 10, 11], True, "length", seq=moved.seq))
    assert handle.result(timeout=10) == [7, 8, 9, 10, 11]


def test_with_every_prefill_rank_dead_a_request_fails_typed_naming_one(rig: Rig) -> None:
    client, _ = rig
    for rank in range(2):
        client.mark_dead(EngineDeadError(rank, "n", DeathCause.KILLED, "test"))
    with pytest.raises(EngineDeadError, match="rank 0"):
        client.submit(PROMPT, max_tokens=3).result(timeout=10)


def test_kv_that_never_reaches_the_decode_rank_fails_the_request_typed_and_aborts_it_there() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    engines = [ctx.socket(zmq.ROUTER) for _ in range(2)]
    collect, publish = ctx.socket(zmq.PULL), ctx.socket(zmq.PUB)
    addr = {s: f"tcp://127.0.0.1:{s.bind_to_random_port('tcp://127.0.0.1')}" for s in (*engines, collect, publish)}
    endpoints = ClusterEndpoints(
        "pdkv",
        [EngineEndpoint(r, f"node{r}", [addr[e]]) for r, e in enumerate(engines)],
        CoordinatorEndpoints("n", [addr[publish]], [addr[collect]], [addr[collect]]),
        lockstep=False,
        prefill_ranks=1,
    )
    client = Client(endpoints, node_id="n", follow_liveness=False, kv_timeout_s=0.5)
    try:
        handle = client.submit(PROMPT, max_tokens=4)
        rank, identity, first = receive(engines, range(1))
        reply(engines, rank, identity, Output(first.request_id, [7], True, "length", seq=first.seq))
        _, _, rest = receive(engines, range(1, 2))  # the decode rank never answers: its KV never came
        with pytest.raises(KVTransferError, match=r"decode rank 1 on node node1 made no token within 0\.5s") as info:
            handle.result(timeout=10)
        assert (info.value.rank, info.value.waited_s) == (1, 0.5) and handle.tokens == [7]
        assert engines[1].poll(5000), "the request is aborted on the decode rank"
        _, tag, body = engines[1].recv_multipart()
        assert tag == RequestType.ABORT.value and abort_decoder(body).request_ids == [rest.request_id]
    finally:
        client.close()
        ctx.destroy(linger=0)


def test_a_bad_kv_timeout_is_refused_naming_it() -> None:
    endpoints = ClusterEndpoints("x", [], CoordinatorEndpoints("n", [], [], []), lockstep=False)
    for bad in (0, -1, True, "5"):
        with pytest.raises(ConfigError, match=f"kv_timeout_s={bad!r}: must be a number of seconds > 0"):
            Client(endpoints, node_id="n", follow_liveness=False, kv_timeout_s=bad)  # type: ignore[arg-type]


def test_prefill_ranks_are_chosen_by_the_prompts_prefix_decode_ranks_by_load(rig: Rig) -> None:
    from raydp.client.prefix import preference, prefix_key

    client, engines = rig
    # Two prompts whose prefixes prefer different prefill ranks: a load-only choice would send both to rank 0.
    prompts = [[k, 1, 2, 3] for k in range(40)]
    first_choice = {preference(prefix_key(p), [0, 1])[0]: p for p in prompts}
    assert set(first_choice) == {0, 1}
    for rank, prompt in sorted(first_choice.items()):
        for _ in range(2):  # the same prefix again: the same prefill rank
            handle = client.submit(prompt, max_tokens=2)
            got, identity, first = receive(engines, range(2))
            assert got == rank, f"prompt {prompt[:2]} prefilled on rank {got}, its prefix prefers {rank}"
            reply(engines, got, identity, Output(first.request_id, [9], True, "length", seq=first.seq))
            decode, identity, rest = receive(engines, range(2, 4))
            reply(engines, decode, identity, Output(rest.request_id, [8], True, "length", seq=rest.seq))
            assert handle.result(timeout=10) == [9, 8]


def test_a_client_in_another_process_follows_the_pools_boundary_from_the_coordinators_snapshots() -> None:
    with cluster_of_four(follow_liveness=True) as (client, engines, publish):
        deadline = time.monotonic() + 10
        while client.endpoints.prefill_ranks != 3 and time.monotonic() < deadline:
            publish.send(encode(StatsSnapshot([(0, 0)] * 4, 0, False, seq=1, prefill_ranks=3)))
            time.sleep(0.05)
        assert client.endpoints.prefill_ranks == 3, "the prefill pool grew to ranks 0..2"
        handles = [client.submit(PROMPT, max_tokens=3) for _ in range(6)]
        firsts = [receive(engines, range(3)) for _ in handles]
        assert {rank for rank, _, _ in firsts} <= {0, 1, 2}
        for rank, identity, first in firsts:
            reply(engines, rank, identity, Output(first.request_id, [7], True, "length", seq=first.seq))
        for _ in handles:
            rank, identity, rest = receive(engines, range(3, 4))
            reply(engines, rank, identity, Output(rest.request_id, [8, 9], True, "length", seq=rest.seq))
        assert [h.result(timeout=10) for h in handles] == [[7, 8, 9]] * 6, "every decode went to rank 3"
