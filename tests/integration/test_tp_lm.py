"""The tensor-parallel reference LM on real workers: every layout gives the same greedy tokens.

The reference is computed in this process (one shard, no workers), so each
launch below is compared against the same independent answer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import raydp
from raydp.errors import ConfigError
from raydp.models.tp_lm import TPLMEngine, logical_weights, save_checkpoint
from raydp.wire.protocol import Request
from tests.integration.helpers import assert_nothing_left, socket_dirs, wait_until
from tests.unit.tp_harness import ThreadExecutor, context

TP_LM = "raydp.models.tp_lm:TPLMEngine"
MODEL = {"vocab": 128, "dim": 32, "layers": 2, "heads": 4, "max_len": 48, "max_running": 8}
PROMPTS = [[(11 * i + 5 * k) % 128 for k in range(1 + i % 9)] for i in range(12)]
MAX_TOKENS = 6


def _reference(**model: Any) -> list[list[int]]:
    """Greedy tokens of every prompt from the unsharded model, one request at a time."""
    engine = TPLMEngine(context(ThreadExecutor(1)), **{**MODEL, **model})
    outputs = []
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(Request(f"r{i}", prompt, MAX_TOKENS))
        tokens: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.token_ids
        outputs.append(tokens)
    return outputs


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return _reference()


def _served(cluster: raydp.Cluster) -> tuple[list[list[int]], set[int]]:
    """All prompts at once (batched together on the ranks), in prompt order, and the ranks used."""
    client = cluster.client()
    handles = [client.submit(p, max_tokens=MAX_TOKENS) for p in PROMPTS]
    return [h.result(timeout=120) for h in handles], {h.rank for h in handles}


@pytest.mark.timeout(300)
def test_dp2_tp2_on_ray_matches_the_unsharded_model(two_nodes, reference) -> None:  # type: ignore[no-untyped-def]
    with raydp.launch(
        name="tplm", dp_size=2, tensor_parallel_size=2, engine=TP_LM, engine_kwargs=MODEL, progress=False
    ) as cluster:
        outputs, ranks = _served(cluster)
        assert ranks == {0, 1}
        assert outputs == reference
        assert len({tuple(o) for o in outputs}) > 3, "different prompts give different tokens"
        client = cluster.client()
        for rank in (0, 1):
            workers = client.call_utility(rank, "raydp_workers")
            assert [w["tp_rank"] for w in workers] == [0, 1]
            stats = client.call_utility(rank, "stats")["workers"]
            assert all(s["steps"] > 0 for s in stats), "every shard ran the forward passes"

            # A finished sequence's KV goes with the rank's next step input, one step after its last output.
            def freed(rank: int = rank) -> bool:
                return all(s["cached_sequences"] == 0 for s in client.call_utility(rank, "stats")["workers"])

            assert wait_until(freed, timeout=10), "finished sequences freed their KV cache"
    assert_nothing_left("tplm")


@pytest.mark.timeout(300)
def test_p_d_pools_of_their_own_tp_sizes_on_ray_match_the_unsharded_model(two_nodes, reference) -> None:  # type: ignore[no-untyped-def]
    with raydp.launch(
        name="tplmpd",
        prefill_dp_size=1,
        decode_dp_size=2,
        prefill_tensor_parallel_size=2,
        engine=TP_LM,
        engine_kwargs=MODEL,
        progress=False,
    ) as cluster:
        outputs, ranks = _served(cluster)
        assert outputs == reference and ranks == {1, 2}, "prefilled on rank 0, decoded on ranks 1 and 2"
        client = cluster.client()
        workers = {r: client.call_utility(r, "raydp_workers") for r in range(3)}
        assert {r: [w["tp_rank"] for w in ws] for r, ws in workers.items()} == {0: [0, 1], 1: [0], 2: [0]}
        devices = [(w["node_id"], d) for ws in workers.values() for w in ws for d in w["device_ids"]]
        assert len(devices) == len(set(devices)) == 4, "4 devices, none shared"
        with pytest.raises(ConfigError, match="pool='prefill': the prefill pool grows and shrinks by trading ranks"):
            cluster.scale(2, pool="prefill")
        cluster.scale(3, pool="decode")  # the new rank is a decode rank: one device
        assert [w["tp_rank"] for w in client.call_utility(3, "raydp_workers")] == [0]
        outputs, ranks = _served(cluster)
        assert outputs == reference and ranks <= {1, 2, 3}
    assert_nothing_left("tplmpd")


@pytest.mark.timeout(300)
def test_mp_backend_p_d_pools_of_their_own_tp_sizes_match_the_unsharded_model(reference: list[list[int]]) -> None:
    with raydp.launch(
        name="tplmmppd",
        prefill_dp_size=1,
        decode_dp_size=1,
        prefill_tensor_parallel_size=2,
        backend="mp",
        engine=TP_LM,
        engine_kwargs=MODEL,
        progress=False,
    ) as cluster:
        outputs, ranks = _served(cluster)
        assert outputs == reference and ranks == {1}
        client = cluster.client()
        assert [w["device_ids"] for w in client.call_utility(0, "raydp_workers")] == [["0"], ["1"]]
        assert [w["device_ids"] for w in client.call_utility(1, "raydp_workers")] == [["2"]]
    assert socket_dirs("tplmmppd") == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [1, 2])
def test_mp_backend_tp_sizes_match_the_unsharded_model(tp: int, reference: list[list[int]]) -> None:
    with raydp.launch(
        name=f"tplmmp{tp}",
        dp_size=1,
        tensor_parallel_size=tp,
        backend="mp",
        engine=TP_LM,
        engine_kwargs=MODEL,
        progress=False,
    ) as cluster:
        outputs, _ = _served(cluster)
        assert outputs == reference
    assert socket_dirs(f"tplmmp{tp}") == []


@pytest.mark.timeout(300)
def test_a_saved_checkpoint_loads_into_tp2_workers_and_gives_the_seeded_models_tokens(tmp_path: Path) -> None:
    shape = {k: MODEL[k] for k in ("vocab", "dim", "layers", "heads", "max_len")}
    path = tmp_path / "tiny.safetensors"
    save_checkpoint(path, logical_weights(**shape, seed=7))
    expected = _reference(seed=7)
    assert expected != _reference(seed=0), "the seed matters, so the checkpoint is what is being tested"
    with raydp.launch(
        name="tplmckpt",
        dp_size=1,
        tensor_parallel_size=2,
        backend="mp",
        engine=TP_LM,
        engine_kwargs={**MODEL, "checkpoint": str(path)},
        progress=False,
    ) as cluster:
        outputs, _ = _served(cluster)
    assert outputs == expected


@pytest.fixture(scope="module")
def two_single_gpu_nodes(cluster_pool):  # type: ignore[no-untyped-def]
    return cluster_pool.get((1, 1))


@pytest.mark.timeout(300)
def test_span_tp2_over_two_nodes_serves_the_unsharded_models_tokens(two_single_gpu_nodes, reference) -> None:  # type: ignore[no-untyped-def]
    with raydp.launch(
        name="tplmspan",
        dp_size=1,
        tensor_parallel_size=2,
        placement_strategy="span",
        engine=TP_LM,
        engine_kwargs=MODEL,
        progress=False,
    ) as cluster:
        workers = cluster.client().call_utility(0, "raydp_workers")
        assert len({w["node_id"] for w in workers}) == 2, "one worker on each node"
        outputs, _ = _served(cluster)
        assert outputs == reference
    assert_nothing_left("tplmspan")
