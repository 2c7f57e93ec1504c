"""``raydp serve --prefill-dp-size 1 --decode-dp-size 1`` answers what vLLM's own server answers.

The differential corpus of ``test_vllm_parity`` (vLLM's answers from the one
run per session) goes to a raydp server whose requests prefill on one rank and
decode on another, their KV moved through vLLM's ``ExampleConnector``. A
client sees one ordinary OpenAI response: the same text, logprobs, usage and
finish reasons as a collocated server's. What a split cannot resume (n=2 with
a seed, penalties, structured outputs) runs whole on the decode rank, with the
same answers. The decode rank's log shows vLLM's connector loading the long
prompt's KV, and the connector leaves no prompt's files once the corpus is done.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from raydp.models.vllm.kv_files import KvFiles
from tests.integration.conftest import ClusterPool
from tests.integration.http_helpers import Served, raydp_serve
from tests.integration.vllm_corpus import (
    CORPUS,
    RUNTIME_LORA,
    STREAMED,
    ask_all,
    corpus_adapters,
    corpus_flags,
    vllm_corpus_answers,
)
from tests.integration.vllm_helpers import tiny_model

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


@pytest.fixture(scope="module")
def model() -> Path:
    return tiny_model()


@pytest.fixture(scope="module")
def adapters(model: Path) -> dict[str, str]:
    return corpus_adapters(model)


@pytest.fixture(scope="module")
def flags(adapters: dict[str, str]) -> list[str]:
    return corpus_flags(adapters)


@pytest.fixture(scope="module")
def vllm_answers(model: Path, flags: list[str], adapters: dict[str, str]) -> dict[str, Any]:
    return vllm_corpus_answers(model, flags, adapters)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pd-kv")


@pytest.fixture(scope="module")
def served(
    cluster_pool: ClusterPool, model: Path, flags: list[str], store: Path, vllm_answers: dict[str, Any]
) -> Iterator[Served]:
    cluster_pool.shutdown()  # the mp backend needs no Ray: spare the 2 cores
    kv = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }
    ours = ["--name", "pdserve", "--engine", "vllm", "--model", str(model), "--accelerator", "CPU"]
    pools = ["--prefill-dp-size", "1", "--decode-dp-size", "1", "--kv-transfer-config", json.dumps(kv)]
    # The connector logs what it found at INFO; to the server's stderr file (its stdout is a pipe nobody drains).
    env = {**RUNTIME_LORA, "VLLM_LOGGING_LEVEL": "INFO", "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
    with raydp_serve(*ours, *pools, *flags, env=env) as server:
        yield server


@pytest.fixture(scope="module")
def pd_answers(served: Served, adapters: dict[str, str]) -> dict[str, Any]:
    return ask_all(served.url, adapters)


@pytest.mark.parametrize("name", [name for name, _, _ in CORPUS + STREAMED])
def test_p_d_answers_as_vllm_does(name: str, vllm_answers: dict[str, Any], pd_answers: dict[str, Any]) -> None:
    ours, theirs = pd_answers[name], vllm_answers[name]
    assert ours == theirs, f"raydp P/D:\n{json.dumps(ours, indent=1)}\nvLLM:\n{json.dumps(theirs, indent=1)}"


def test_the_decode_rank_loaded_the_long_prompts_kv_and_no_file_is_left(
    served: Served, pd_answers: dict[str, Any], store: Path
) -> None:
    assert pd_answers["long prompt"]["status"] == 200
    # vLLM's connector logs each KV it loads: the long prompt's two blocks, on the decode rank (dp1) alone.
    log = Path(served.stderr_path).read_text().splitlines()
    loads = [line for line in log if "Inject KV cache of" in line]
    assert [line.split(")")[0].split()[0] for line in loads] == ["(pdserve-dp1"], loads
    assert "Inject KV cache of 256 tokens" in loads[0]
    # vLLM's own front-end counts a stream's prompt tokens from its first output (the prefill's): all computed.
    by_source = {
        sample.labels["source"]: sample.value
        for family in text_string_to_metric_families(httpx.get(served.url + "/metrics", timeout=30).text)
        if family.name == "vllm:prompt_tokens_by_source"
        for sample in family.samples
        if sample.name.endswith("_total")
    }
    assert by_source["local_compute"] >= 300 and by_source["external_kv_transfer"] == 0, by_source
    shared = Path(KvFiles(str(store), 128).shared_folder()).name  # every prompt shorter than a block: left
    assert sorted(p.name for p in store.iterdir() if p.name != shared) == [], "no prompt's files are left"
