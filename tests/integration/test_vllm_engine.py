"""vLLM engine cores in raydp ranks on a real Ray cluster: vLLM's own tokens, sampling, failures.

One cluster (DP=2, CPU bundles, the small offline checkpoint) serves the whole
module: a vLLM engine start costs ~10 s here. The rank-death test runs last
and leaves the cluster as it found it (the rank restarts).
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import raydp
from raydp import Sampling
from raydp.client.prefix import preference, prefix_key
from raydp.errors import ConfigError, EngineDeadError, StartupError
from tests.integration.conftest import ClusterPool
from tests.integration.helpers import wait_until
from tests.integration.vllm_helpers import ENGINE_KWARGS, tiny_model, vllm_kv_blocks, vllm_reference, want_reference

pytestmark = pytest.mark.timeout(300)
ENGINE = "raydp.models.vllm:VllmEngine"
PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], [42] * 10, [1]]
SEEDED = Sampling(temperature=0.8, top_p=0.95, seed=1234)


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_model())


@pytest.fixture(scope="module")
def cluster(cluster_pool: ClusterPool, model: str) -> Iterator[Any]:
    cluster_pool.get((0,), cpus_per_node=4)  # 2 ranks x (1 CPU device bundle + 1 engine CPU)
    with raydp.launch(
        name="vllm",
        dp_size=2,
        accelerator="CPU",
        engine=ENGINE,
        max_restarts=1,
        progress=False,
        engine_kwargs={"model": model, **ENGINE_KWARGS},
    ) as launched:
        yield launched


STOP = "e"  # a stop string common enough in the model's text to end a 12-token answer early
REFERENCE = want_reference(
    [(p, {"temperature": 0.0, "max_tokens": 12}) for p in PROMPTS]
    + [(PROMPTS[0], {"temperature": 0.8, "top_p": 0.95, "seed": 1234, "max_tokens": 12})]
)
# The same prompt with the settings that end a request: each expectation is vLLM's own answer to them.
ENDINGS = want_reference(
    [
        (PROMPTS[0], {"temperature": 0.0, "max_tokens": 12, "stop": [STOP]}),
        (PROMPTS[0], {"temperature": 0.0, "max_tokens": 40, "ignore_eos": True}),
    ]
)
MOVING = 480  # tokens: seconds of decoding here, so a stream is still running when its rank is killed
LONG = want_reference([(p, {"temperature": 0.0, "max_tokens": MOVING, "ignore_eos": True}) for p in PROMPTS])


@pytest.fixture(scope="module")
def reference(model: str) -> list[list[int]]:
    return vllm_reference(Path(model), REFERENCE)


def test_greedy_tokens_are_vllms_own_on_every_rank(cluster: Any, reference: list[list[int]]) -> None:
    client = cluster.client()
    for rank in (0, 1):
        got = [client.generate(p, 12, rank=rank, timeout=60) for p in PROMPTS]
        assert got == reference[: len(PROMPTS)], f"rank {rank}"
    batch = client.submit_many(PROMPTS, 12)
    assert [h.result(60) for h in batch] == reference[: len(PROMPTS)], "batched together, the same tokens"


def test_a_seeded_sampled_request_gives_vllms_tokens_for_that_seed(cluster: Any, reference: list[list[int]]) -> None:
    client = cluster.client()
    assert client.generate(PROMPTS[0], 12, sampling=SEEDED, timeout=60) == reference[-1]
    unseeded = Sampling(temperature=1.0)
    answers = {tuple(client.generate(PROMPTS[0], 12, sampling=unseeded, timeout=60)) for _ in range(3)}
    assert len(answers) > 1, "without a seed, sampling varies"


def test_stop_tokens_stop_strings_and_ignore_eos_end_requests_as_vllm_ends_them(
    cluster: Any, model: str, reference: list[list[int]]
) -> None:
    client = cluster.client()
    stop_token = reference[0][3]  # one that vLLM's greedy answer holds, so that it ends the request early
    by_token, by_string, past_eos = vllm_reference(
        Path(model),
        [(PROMPTS[0], {"temperature": 0.0, "max_tokens": 12, "stop_token_ids": [stop_token]}), *ENDINGS],
    )
    handle = client.submit(PROMPTS[0], 12, sampling=Sampling(stop_token_ids=[stop_token]))
    assert (handle.result(60), handle.finish_reason) == (by_token, "stop") and len(by_token) < 12
    handle = client.submit(PROMPTS[0], 12, sampling=Sampling(stop=[STOP]))
    assert (handle.result(60), handle.finish_reason) == (by_string, "stop") and len(by_string) < 12
    handle = client.submit(PROMPTS[0], 40, sampling=Sampling(ignore_eos=True))
    assert (handle.result(60), handle.finish_reason) == (past_eos, "length")


def test_load_work_capacity_and_aborts_are_vllms(cluster: Any, model: str) -> None:
    client = cluster.client()
    assert cluster.capacity == 2 * vllm_kv_blocks(Path(model)) > 0, "vLLM's own KV blocks, summed over the ranks"
    long = client.submit([3, 4, 5], 400, rank=0, sampling=Sampling(ignore_eos=True))
    assert wait_until(lambda: len(long.tokens) > 0, timeout=30)
    client.abort(long.request_id)
    long.result(30)
    assert long.finish_reason == "abort" and len(long.tokens) < 400
    assert wait_until(lambda: _counts(client, 0) == (0, 0), timeout=10), "the abort reached vLLM's scheduler"


def test_a_request_vllm_refuses_fails_alone_with_vllms_reason(cluster: Any) -> None:
    client = cluster.client()
    with pytest.raises(raydp.RequestError, match=r"max_model_len|maximum model length|longer than"):
        client.generate(list(range(1, 600)), 4, rank=0, timeout=60)
    assert client.generate(PROMPTS[1], 2, rank=0, timeout=60), "the rank serves on"


def test_vllms_cache_events_steer_prefix_routing_and_its_hit_rate_is_shown(cluster: Any) -> None:
    """vLLM reports what its prefix cache holds: a prompt cached on rank 1 goes to rank 1 even where
    the prefix hash names rank 0, and the coordinator shows rank 1's hits."""
    pinned, routed = cluster.client(), cluster.client(balancer="prefix")
    block = pinned.call_utility(1, "describe")["block_size"]
    prompt = next(
        p
        for p in ([(k * 37 + i * 11) % 900 + 1 for i in range(2 * block + 3)] for k in range(100))
        if preference(prefix_key(p), range(2))[0] == 0
    )
    before = cluster.coordinator_state().prefix_cache[1]
    assert pinned.generate(prompt, max_tokens=2, rank=1)
    assert wait_until(lambda: cluster.coordinator_state().prefix_cache[1][0] > before[0], timeout=10)
    assert wait_until(lambda: routed.cached_blocks()[1] >= 2, timeout=10), routed.cached_blocks()
    handle = routed.submit([*prompt, 5], max_tokens=2)
    handle.result(60)
    assert handle.rank == 1
    assert wait_until(lambda: cluster.coordinator_state().prefix_cache[1][1] - before[1] >= 2 * block, timeout=10), (
        cluster.coordinator_state().prefix_cache
    )


def test_a_bad_vllm_field_fails_the_launch_naming_it(cluster: Any, model: str) -> None:
    with pytest.raises((ConfigError, StartupError), match=r"engine_kwargs\.max_modle_len: not a vLLM engine argument"):
        raydp.launch(
            name="vllm-bad",
            dp_size=1,
            accelerator="CPU",
            engine=ENGINE,
            progress=False,
            engine_kwargs={"model": model, "max_modle_len": 64},
            startup_timeout_s=120,
        )


def test_a_killed_vllm_rank_fails_its_requests_typed_migrates_opted_in_streams_and_comes_back(
    cluster: Any, model: str
) -> None:
    long = vllm_reference(Path(model), LONG)
    rendezvous = set(Path(tempfile.gettempdir()).glob("vllm_dist_*"))  # the ranks' temp folder is this one
    client = cluster.client()
    pid = client.call_utility(1, "describe")["pid"]
    load = [client.submit(PROMPTS[i % 4], 64, sampling=Sampling(ignore_eos=True)) for i in range(16)]
    # Rank 0 gets 4 more, so the least-loaded choice puts the migratable streams on rank 1.
    load += [client.submit(PROMPTS[i], 64, sampling=Sampling(ignore_eos=True), rank=0) for i in range(4)]
    moving = [client.submit(p, MOVING, sampling=Sampling(ignore_eos=True), migratable=True) for p in PROMPTS]
    assert wait_until(lambda: all(h.rank is not None for h in load + moving), timeout=30)
    on_victim = [h.rank == 1 for h in moving]
    assert any(on_victim), [h.rank for h in moving]
    assert wait_until(lambda: all(h.tokens for h, m in zip(moving, on_victim, strict=True) if m), timeout=30)
    assert not any(h.done() for h in moving), "still streaming when the rank dies"
    os.kill(pid, signal.SIGKILL)
    # Greedy: continued from their last token on rank 0, they give what an uninterrupted run gives.
    assert [h.result(120) for h in moving] == long
    assert [h.rank for h in moving] == [0] * len(moving) and client.migrations == sum(on_victim), (
        [h.rank for h in moving],
        on_victim,
        client.migrations,
    )
    answered = failed = 0
    for handle in load:
        try:
            assert len(handle.result(120)) == 64
            answered += 1
        except EngineDeadError as exc:
            assert exc.rank == 1 and handle.rank == 1, "only the killed rank's requests fail"
            failed += 1
    assert answered + failed == 20 and answered >= 1, "no request is lost: answered or failed typed"
    during = client.generate(PROMPTS[0], 4, rank=0, timeout=60)
    assert len(during) == 4, "the other rank answers throughout"
    started = time.monotonic()
    assert wait_until(lambda: _serves(client, 1), timeout=180), "the rank restarts, model reload included"
    assert time.monotonic() - started < 180
    # vLLM's one-process executor meets torch in a file it makes there, which a killed process never
    # removes: every restart would leave one. A rank's rendezvous file is in its own IPC directory.
    assert set(Path(tempfile.gettempdir()).glob("vllm_dist_*")) - rendezvous == set()


def _serves(client: Any, rank: int) -> bool:
    try:
        return len(client.generate(PROMPTS[1], 2, rank=rank, timeout=10)) == 2
    except raydp.RaydpError:
        return False


def _counts(client: Any, rank: int) -> tuple[int, int]:
    snapshot = client.snapshot()
    return tuple(snapshot.counts[rank]) if snapshot is not None else (-1, -1)
