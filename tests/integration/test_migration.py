"""Stream migration: a stream whose rank dies mid-stream goes on from its last token on a live rank.

The reference LM (greedy, seeded weights, the same on every rank) runs 20 ms a
step on an in-process mp cluster without restarts, so a stream is still
running when the test SIGKILLs its rank. Greedy decoding continued from the
prompt plus the tokens streamed gives what the uninterrupted run gives, so a
migrated answer must equal the reference token for token: nothing repeated,
nothing dropped. Over HTTP, the official SDK's stream is one stream, and
``/metrics`` counts the move.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import raydp
from raydp.errors import ConfigError, EngineDeadError
from raydp.serve.settings import ServerSettings
from tests.integration.helpers import wait_until
from tests.integration.http_helpers import call

pytestmark = pytest.mark.timeout(180)
ENGINE = "raydp.models.tiny_lm:TinyLMEngine"
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
N = 60  # tokens: over a second at 20 ms a step


@contextmanager
def tiny_cluster(name: str, dp_size: int) -> Iterator[raydp.Cluster]:
    with raydp.launch(
        name=name,
        dp_size=dp_size,
        backend="mp",
        engine=ENGINE,
        max_restarts=0,
        progress=False,
        engine_kwargs={"step_delay_s": 0.02},
    ) as cluster:
        yield cluster


def kill_rank(cluster: raydp.Cluster, rank: int) -> None:
    procs = cluster._manager.procs  # type: ignore[union-attr]
    os.kill(next(p for p in procs if p.rank == rank).process.pid, signal.SIGKILL)


def test_a_migratable_stream_goes_on_from_its_last_token_and_one_without_opt_in_fails_typed() -> None:
    with tiny_cluster("migr", 2) as cluster:
        client = cluster.client()
        reference = client.generate(PROMPT, N, rank=0, timeout=60)
        assert client.generate(PROMPT, N, rank=1, timeout=60) == reference, "every rank has the same weights"
        moving = client.submit(PROMPT, N, migratable=True)
        assert wait_until(lambda: moving.rank is not None, timeout=10)
        victim = moving.rank
        assert victim is not None
        staying = client.submit(PROMPT, N, rank=victim)  # no opt-in (and pinned): it must fail
        chunks: list[list[int]] = []
        reader = threading.Thread(target=lambda: chunks.extend(moving.stream(timeout=60)))
        reader.start()
        assert wait_until(lambda: len(moving.tokens) >= 5 and staying.tokens, timeout=30), "both are streaming"
        kill_rank(cluster, victim)
        reader.join(timeout=90)
        assert [t for chunk in chunks for t in chunk] == reference, "one stream, nothing repeated or dropped"
        assert moving.result(10) == reference and moving.finish_reason == "length"
        assert moving.ranks == [victim, 1 - victim] and client.migrations == 1
        with pytest.raises(EngineDeadError) as info:
            staying.result(30)
        assert f"rank {victim}" in str(info.value)
        with pytest.raises(ConfigError, match="migratable=True with rank=0"):
            client.submit(PROMPT, N, rank=0, migratable=True)


def test_a_stream_moves_at_most_migration_limit_times_then_fails_with_the_rank_error() -> None:
    with tiny_cluster("migrlim", 3) as cluster:
        client = cluster.client(migration_limit=1)
        moving = client.submit(PROMPT, N, migratable=True)
        assert wait_until(lambda: len(moving.tokens) >= 3, timeout=30)
        first = moving.rank
        assert first is not None
        kill_rank(cluster, first)
        assert wait_until(lambda: moving.rank != first and len(moving.tokens) >= 8, timeout=30), "moved once"
        second = moving.rank
        assert second is not None
        kill_rank(cluster, second)
        with pytest.raises(EngineDeadError) as info:
            moving.result(30)
        assert f"rank {second}" in str(info.value) and client.migrations == 1


def test_over_http_the_sdk_sees_one_stream_and_metrics_count_the_move() -> None:
    with tiny_cluster("migrhttp", 2) as cluster:
        client = cluster.client()
        reference = client.generate(PROMPT, N, rank=0, timeout=60)
        servers = cluster.serve_api(1, port=0, settings=ServerSettings(migration_limit=1))
        sdk = openai.OpenAI(base_url=f"{servers.url}/v1", api_key="x", max_retries=0, timeout=60)
        stream = sdk.completions.create(model="migrhttp", prompt=PROMPT, max_tokens=N, stream=True)
        tokens: list[int] = []
        ranks: list[int] = []  # the serving rank of each chunk, in order
        killed = False
        for chunk in stream:
            extra = (chunk.choices[0].model_extra or {}) if chunk.choices else {}
            tokens += extra.get("token_ids") or []
            if extra.get("rank") is not None:
                ranks.append(extra["rank"])
            if len(tokens) >= 5 and not killed:
                kill_rank(cluster, ranks[-1])
                killed = True
        assert tokens == reference, "one stream, nothing repeated or dropped"
        switches = [i for i in range(1, len(ranks)) if ranks[i] != ranks[i - 1]]
        assert len(switches) == 1, f"one rank, then the other: {ranks}"
        metrics = call(servers.address, "GET", "/metrics").body.decode()
        moved = next(f for f in text_string_to_metric_families(metrics) if f.name == "raydp_stream_migrations")
        assert moved.samples[0].value == 1.0
