"""P/D pools on reference engines: one stream per request over a prefill rank and a decode rank.

The reference LM (greedy, seeded weights, the same on every rank) runs on an
in-process mp cluster without restarts. Greedy decoding continued from the
prompt plus its first token gives what one rank gives for the whole request,
so a P/D answer must equal the answer of a request pinned to one rank, token
for token. The kills land while requests are on the killed pool's ranks:
nothing may be lost, repeated or dropped.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

import raydp
from raydp.client.requests import RequestHandle
from raydp.errors import ConfigError
from tests.integration.helpers import wait_until

pytestmark = pytest.mark.timeout(180)
ENGINE = "raydp.models.tiny_lm:TinyLMEngine"
PROMPTS = [[(7 * i + 3 * k) % 97 + 1 for k in range(4 + i % 5)] for i in range(12)]


@contextmanager
def pd_cluster(name: str, prefill: int, decode: int, step_delay_s: float = 0.02) -> Iterator[raydp.Cluster]:
    with raydp.launch(
        name=name,
        prefill_dp_size=prefill,
        decode_dp_size=decode,
        backend="mp",
        engine=ENGINE,
        max_restarts=0,
        progress=False,
        engine_kwargs={"step_delay_s": step_delay_s},
    ) as cluster:
        yield cluster


def kill_rank(cluster: raydp.Cluster, rank: int) -> None:
    procs = cluster._manager.procs  # type: ignore[union-attr]
    os.kill(next(p for p in procs if p.rank == rank).process.pid, signal.SIGKILL)


def whole(client: raydp.Client, prompts: list[list[int]], n: int, rank: int) -> list[list[int]]:
    """Each prompt's answer from one rank alone (a pinned request is never split)."""
    return [client.generate(p, n, rank=rank, timeout=60) for p in prompts]


def test_p_d_answers_equal_one_ranks_and_every_stream_ends_on_a_decode_rank() -> None:
    with pd_cluster("pd-equal", 1, 2, step_delay_s=0.0) as cluster:
        assert cluster.dp_size == 3 and cluster.endpoints.prefill_ranks == 1
        client = cluster.client()
        reference = whole(client, PROMPTS, 12, rank=1)
        handles = [client.submit(p, 12) for p in PROMPTS]
        assert [h.result(60) for h in handles] == reference
        assert {h.rank for h in handles} <= {1, 2}, "every stream ends on a decode rank"
        assert all(h.ranks == [0, h.rank] for h in handles), "each prefilled on rank 0, then decoded"
        assert all(h.finish_reason == "length" for h in handles)
        one = client.submit(PROMPTS[0], 1)
        assert one.result(30) == reference[0][:1] and one.ranks == [0], "a one-token request is all prefill"


def test_a_prefill_rank_killed_mid_prefill_loses_no_request() -> None:
    # 0.3 s a step: the prefill step of every request in flight is still running at the kill.
    with pd_cluster("pd-kill-p", 2, 1, step_delay_s=0.3) as cluster:
        client = cluster.client()
        reference = whole(client, PROMPTS[:6], 4, rank=2)
        handles = [client.submit(p, 4) for p in PROMPTS[:6]]
        assert wait_until(lambda: any(h.rank == 0 for h in handles), timeout=10), "a request is on rank 0"
        kill_rank(cluster, 0)
        assert [h.result(60) for h in handles] == reference, "each went on from another prefill rank"
        assert {h.rank for h in handles} == {2} and client.migrations == 0
        after = client.submit(PROMPTS[7], 4)
        assert after.result(60) == whole(client, [PROMPTS[7]], 4, rank=2)[0], "rank 1 prefills alone now"


def test_a_decode_rank_killed_mid_stream_moves_its_streams_to_the_other() -> None:
    n = 60  # over a second at 20 ms a step
    with pd_cluster("pd-kill-d", 1, 2) as cluster:
        client = cluster.client()
        reference = whole(client, PROMPTS[:4], n, rank=1)
        handles = [client.submit(p, n, migratable=True) for p in PROMPTS[:4]]
        chunks: list[list[list[int]]] = [[] for _ in handles]
        readers = [
            threading.Thread(target=lambda h=h, c=c: c.extend(h.stream(timeout=60)))
            for h, c in zip(handles, chunks, strict=True)
        ]
        for reader in readers:
            reader.start()
        assert wait_until(lambda: all(len(h.tokens) >= 5 for h in handles), timeout=30), "all are streaming"
        victim = handles[0].rank
        assert victim in (1, 2)
        kill_rank(cluster, victim)
        for reader in readers:
            reader.join(timeout=90)
        assert [[t for chunk in c for t in chunk] for c in chunks] == reference, "nothing repeated or dropped"
        assert {h.rank for h in handles} == {3 - victim} and client.migrations >= 1


def test_each_pool_scales_on_its_own_under_load_and_no_request_is_lost() -> None:
    n = 20  # 0.4 s of decoding at 20 ms a step: a shrink lands while they stream, a grow starts while they do
    with pd_cluster("pd-scale", 1, 1) as cluster:
        client = cluster.client()
        reference = whole(client, PROMPTS, n, rank=1)

        def scaled(size: int, pool: str) -> list[RequestHandle]:
            handles = [client.submit(p, n) for p in PROMPTS]
            cluster.scale(size, pool=pool, drain_timeout_s=30)
            assert [h.result(60) for h in handles] == reference, f"nothing lost across the {pool} pool's change"
            after = [client.submit(p, n) for p in PROMPTS]
            assert [h.result(60) for h in after] == reference
            return after

        after = scaled(2, "decode")
        assert (cluster.dp_size, cluster.endpoints.prefill_ranks) == (3, 1)
        assert {h.rank for h in after} == {1, 2}, "the new decode rank takes streams"
        after = scaled(2, "prefill")  # rank 2 joins as a decode rank, then rank 1 moves to the prefill pool
        assert (cluster.dp_size, cluster.endpoints.prefill_ranks) == (4, 2)
        assert {h.rank for h in after} == {2, 3}, "every stream ends on the decode pool, ranks 2 and 3"
        after = scaled(1, "prefill")  # rank 1 decodes again, then rank 3 drains and goes
        assert (cluster.dp_size, cluster.endpoints.prefill_ranks) == (3, 1)
        assert {h.rank for h in after} == {1, 2}
        after = scaled(1, "decode")
        assert (cluster.dp_size, cluster.endpoints.prefill_ranks) == (2, 1)
        assert {h.rank for h in after} == {1}
        with pytest.raises(ConfigError, match="dp_size=0: must be an int >= 1"):
            cluster.scale(0, pool="prefill")
        with pytest.raises(ConfigError, match="pool='both': a P/D cluster scales one pool at a time"):
            cluster.scale(2, pool="both")


def autoscaled(name: str, step_delay_s: float, max_running: int, **pools: Any) -> raydp.Cluster:
    """An echo P/D cluster of 1 + 1 ranks (mp backend) whose ``pools`` autoscale on brisk settings:
    ``autoscaling`` (the decode pool), ``prefill_autoscaling``, each its bounds and target."""
    brisk = {"upscale_delay_s": 0, "downscale_delay_s": 1, "look_back_s": 0.3, "interval_s": 0.05}
    return raydp.launch(
        name=name,
        prefill_dp_size=1,
        decode_dp_size=1,
        backend="mp",
        engine="raydp.models.echo:EchoEngine",
        engine_kwargs={"step_delay_s": step_delay_s, "max_running": max_running},
        progress=False,
        **{pool: {**brisk, **bounds} for pool, bounds in pools.items()},
    )


def test_the_autoscaler_sizes_the_prefill_pool_by_its_queue() -> None:
    bounds = {"min_dp_size": 1, "max_dp_size": 2, "target_ongoing_requests": 4}
    with autoscaled("pd-auto-p", 0.05, 2, prefill_autoscaling=bounds) as cluster:
        client = cluster.client()
        # One-token requests are all prefill: 40 of them queue on rank 0 for at least 20 steps (1 s).
        handles = [client.submit(PROMPTS[i % len(PROMPTS)], 1) for i in range(40)]
        assert wait_until(lambda: cluster.endpoints.prefill_ranks == 2, timeout=30), "the prefill pool grew"
        assert cluster.dp_size == 3, "by a rank of its own: the decode pool kept its one"
        assert [h.result(60) for h in handles] == [PROMPTS[i % len(PROMPTS)][:1] for i in range(40)]
        shrunk = wait_until(lambda: (cluster.dp_size, cluster.endpoints.prefill_ranks) == (2, 1), timeout=30)
        assert shrunk, "and shrank back once it was idle"
        assert client.generate(PROMPTS[0], 4, timeout=30) == [PROMPTS[0][k % len(PROMPTS[0])] for k in range(4)]


def test_the_autoscaler_sizes_the_decode_pool_by_its_load_and_leaves_the_prefill_pool() -> None:
    bounds = {"min_dp_size": 1, "max_dp_size": 3, "target_ongoing_requests": 2}
    with autoscaled("pd-auto", 0.02, 4, autoscaling=bounds) as cluster:
        client = cluster.client()
        handles = [client.submit(p, 150) for p in PROMPTS]  # 3 s of decoding: 12 streams on one decode rank
        assert wait_until(lambda: cluster.dp_size == 4, timeout=30), "the decode pool grew to its maximum"
        assert cluster.endpoints.prefill_ranks == 1
        assert all(len(h.result(60)) == 150 for h in handles)
        assert wait_until(lambda: cluster.dp_size == 2, timeout=30), "and shrank back once the load fell"
        assert client.generate(PROMPTS[0], 4, timeout=30) == [PROMPTS[0][k % len(PROMPTS[0])] for k in range(4)]
