"""P/D pools of vLLM engine cores: the prompt's KV goes from the prefill rank to the decode rank.

One prefill and one decode rank (mp backend, the small offline checkpoint) with
vLLM's ``ExampleConnector`` over a directory of the test's own: the prefill
rank stores each prompt's KV there, the decode rank loads it. What the user
sees: vLLM's own greedy tokens, sequential and concurrent; the decode rank's
count of prompt tokens it loaded instead of computing; and an empty directory
once the requests are done. Prompts are longer than a KV block (128 tokens on
the CPU), or nothing would be stored. The last test resizes the prefill
pool both ways, so that a rank serves in each pool in turn.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import raydp
from raydp.errors import RequestError
from raydp.models.vllm.kv_files import KvFiles
from tests.integration.vllm_helpers import ENGINE_KWARGS, tiny_model, vllm_reference, want_reference

pytestmark = pytest.mark.timeout(400)
ENGINE = "raydp.models.vllm:VllmEngine"
BLOCK = 128  # vLLM's KV block on the CPU
PROMPTS = [[(37 * i + 11 * k) % 900 + 5 for k in range(150 + 41 * i)] for i in range(8)]
FIRST, SECOND = PROMPTS[:4], PROMPTS[4:]  # new prompts for the second test: no rank has them cached
THIRD = [[(53 * i + 7 * k) % 900 + 5 for k in range(140 + 30 * i)] for i in range(4)]  # the pools' test
N = 12
REFERENCE = want_reference([(p, {"temperature": 0.0, "max_tokens": N}) for p in [*PROMPTS, *THIRD]])


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv")


@pytest.fixture(scope="module")
def cluster(store: Path) -> Iterator[Any]:
    kv = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }
    with raydp.launch(
        name="vllmpd",
        prefill_dp_size=1,
        decode_dp_size=1,
        accelerator="CPU",
        backend="mp",
        engine=ENGINE,
        engine_kwargs={"model": str(tiny_model()), **ENGINE_KWARGS, "kv_transfer_config": kv},
        progress=False,
    ) as launched:
        yield launched


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return vllm_reference(tiny_model(), REFERENCE)


def left_in(store: Path) -> list[str]:
    """The connector's folders in ``store``, less the one every prompt shorter than a block shares."""
    shared = Path(KvFiles(str(store), BLOCK).shared_folder()).name
    return sorted(p.name for p in store.iterdir() if p.name != shared)


def stored(prompt: list[int]) -> int:
    """The prompt tokens the connector keeps: whole blocks, short of the last token."""
    return (len(prompt) - 1) // BLOCK * BLOCK


def test_greedy_tokens_through_p_d_are_vllms_and_the_decode_rank_loads_the_kv(
    cluster: Any, store: Path, reference: list[list[int]]
) -> None:
    client = cluster.client()
    before = client.call_utility(1, "stats")["kv_loaded_tokens"]
    got = []
    for prompt in FIRST:
        handle = client.submit(prompt, N)
        got.append(handle.result(120))
        assert handle.rank == 1, "it ended on the decode rank"
    assert got == reference[:4]
    loaded = client.call_utility(1, "stats")["kv_loaded_tokens"] - before
    assert loaded == sum(map(stored, FIRST)), "loaded, not computed"
    assert client.call_utility(0, "stats")["kv_loaded_tokens"] == 0
    assert left_in(store) == [], "the connector's files are gone once each request is done"


def test_concurrent_requests_give_the_same_tokens_and_leave_nothing_behind(
    cluster: Any, store: Path, reference: list[list[int]]
) -> None:
    client = cluster.client()
    before = client.call_utility(1, "stats")["kv_loaded_tokens"]
    handles = [client.submit(p, N) for p in SECOND]
    assert [h.result(120) for h in handles] == reference[4 : len(PROMPTS)]
    assert client.call_utility(1, "stats")["kv_loaded_tokens"] - before == sum(map(stored, SECOND))
    assert left_in(store) == []
    # vLLM's ExampleConnector fails a rank on a one-token prompt: the rank refuses it instead, and serves on.
    with pytest.raises(RequestError, match="prompt_token_ids: a one-token prompt fails vLLM's ExampleConnector"):
        client.generate([7], N, timeout=60)
    # A request whose first token ends it never reaches the decode rank: its prefill removes the files.
    one = client.submit(PROMPTS[0][:-1], 1)
    assert len(one.result(60)) == 1 and one.rank == 0
    assert left_in(store) == []


def test_a_rank_moved_between_pools_by_a_scale_serves_its_new_pool(
    cluster: Any, store: Path, reference: list[list[int]]
) -> None:
    client = cluster.client()
    want = reference[len(PROMPTS) :]
    cluster.scale(2, pool="prefill")  # rank 2 starts as a decode rank, then rank 1 prefills
    assert (cluster.dp_size, cluster.endpoints.prefill_ranks) == (3, 2)
    handles = [client.submit(p, N) for p in THIRD[:3]]
    assert [h.result(120) for h in handles] == want[:3]
    assert {h.rank for h in handles} == {2}, "rank 1 prefills now: every stream decodes on the new rank"
    assert client.call_utility(2, "stats")["kv_loaded_tokens"] == sum(map(stored, THIRD[:3])), "it loaded the KV"
    assert left_in(store) == []
    decoded = client.call_utility(1, "stats")["kv_loaded_tokens"]
    cluster.scale(1, pool="prefill")  # rank 1 decodes again, then rank 2 drains and goes
    assert (cluster.dp_size, cluster.endpoints.prefill_ranks) == (2, 1)
    again = client.submit(THIRD[3], N)  # a prompt no rank has cached: its KV must come from rank 0
    assert again.result(120) == want[3] and again.rank == 1
    assert client.call_utility(1, "stats")["kv_loaded_tokens"] - decoded == stored(THIRD[3])
    assert left_in(store) == []
