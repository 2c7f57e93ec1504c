"""The official ``openai`` SDK against ``raydp serve --engine vllm --model DIR --dp-size 2 --api-servers 2
--accelerator CPU`` on an embedded Ray (the command a user runs on this 2-core machine: raydp declares the
4 logical CPUs the plan needs and oversubscribes).

Every expected answer is vLLM's own: its offline ``LLM.generate`` on the same
checkpoint and token ids, decoded with the model's tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from raydp.text.hf_tokenizer import HFTokenizer
from tests.integration.conftest import ClusterPool
from tests.integration.http_helpers import Served, call, raydp_serve
from tests.integration.vllm_helpers import ENGINE_KWARGS, tiny_model, vllm_reference

pytestmark = pytest.mark.timeout(300)
NAME = "vllmoai"
PROMPT = "The quick brown fox jumps over the lazy dog."
MESSAGES: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
SEEDED = {"temperature": 0.8, "top_p": 0.95, "seed": 4321}


@pytest.fixture(scope="module")
def model() -> Path:
    return tiny_model()


@pytest.fixture(scope="module")
def tok(model: Path) -> HFTokenizer:
    return HFTokenizer.load(str(model))


@pytest.fixture(scope="module")
def reference(model: Path, tok: HFTokenizer) -> dict[str, list[int]]:
    prompt, chat = tok.encode(PROMPT), tok.apply_chat_template(MESSAGES)
    greedy = {"temperature": 0.0, "max_tokens": 16}
    answers = vllm_reference(model, [(prompt, greedy), (chat, greedy), (prompt, {**SEEDED, "max_tokens": 16})])
    return dict(zip(("prompt", "chat", "seeded"), answers, strict=True))


@pytest.fixture(scope="module")
def served(cluster_pool: ClusterPool, model: Path) -> Iterator[Served]:
    cluster_pool.shutdown()  # raydp serve starts its own Ray ("local": even if another runs here), as a user's does
    flags = [
        "--dtype",
        "float32",
        "--enforce-eager",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "16",
        "--kv-cache-memory-bytes",
        str(ENGINE_KWARGS["kv_cache_memory_bytes"]),
    ]
    with raydp_serve(
        "--name",
        NAME,
        "--backend",
        "ray",
        "--engine",
        "vllm",
        "--model",
        str(model),
        "--dp-size",
        "2",
        "--api-servers",
        "2",
        "--accelerator",
        "CPU",
        "--address",
        "local",
        *flags,
    ) as s:
        yield s


@pytest.fixture(scope="module")
def sdk(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0, timeout=120)


def test_completions_with_text_and_token_id_prompts_answer_vllms_tokens(
    sdk: openai.OpenAI, tok: HFTokenizer, reference: dict[str, list[int]]
) -> None:
    expected = reference["prompt"]
    done = sdk.completions.create(model=NAME, prompt=PROMPT, max_tokens=16)
    choice = done.choices[0]
    assert (choice.model_extra or {})["token_ids"] == expected and choice.text == tok.decode(expected)
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(tok.encode(PROMPT)), 16)
    chunks = list(sdk.completions.create(model=NAME, prompt=tok.encode(PROMPT), max_tokens=16, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == tok.decode(expected)
    assert [t for c in chunks for t in (c.choices[0].model_extra or {}).get("token_ids", [])] == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_seeded_sampled_completion_is_vllms_for_that_seed(
    sdk: openai.OpenAI, tok: HFTokenizer, reference: dict[str, list[int]]
) -> None:
    done = sdk.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, **SEEDED)
    assert done.choices[0].text == tok.decode(reference["seeded"])


def test_chat_completions_plain_and_streamed_answer_vllms_tokens(
    sdk: openai.OpenAI, tok: HFTokenizer, reference: dict[str, list[int]]
) -> None:
    text = tok.decode(reference["chat"])
    answer = sdk.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=16)
    assert answer.object == "chat.completion" and answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == text
    assert answer.usage is not None and answer.usage.completion_tokens == 16
    assert answer.usage.prompt_tokens == len(tok.apply_chat_template(MESSAGES))
    stream = list(
        sdk.chat.completions.create(
            model=NAME, messages=MESSAGES, max_tokens=16, stream=True, stream_options={"include_usage": True}
        )
    )
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text
    assert stream[-1].usage is not None and stream[-1].usage.total_tokens == answer.usage.total_tokens


def test_a_stop_string_ends_the_text_before_it(
    sdk: openai.OpenAI, tok: HFTokenizer, reference: dict[str, list[int]]
) -> None:
    text = tok.decode(reference["prompt"])
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    done = sdk.completions.create(model=NAME, prompt=PROMPT, max_tokens=16, stop=[stop])
    assert (done.choices[0].text, done.choices[0].finish_reason) == (text[: text.index(stop)], "stop")


def test_a_bad_sampling_value_is_a_400_naming_the_field(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model=NAME, prompt=PROMPT, max_tokens=4, temperature=-1)
    assert bad.value.param == "temperature" and "temperature=-1" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4, top_p=0)
    assert bad.value.param == "top_p"


def test_metrics_count_the_generated_tokens(served: Served, sdk: openai.OpenAI) -> None:
    before = _tokens(served)
    sdk.completions.create(model=NAME, prompt=PROMPT, max_tokens=7, extra_body={"ignore_eos": True})
    assert _tokens(served) - before == 7, "summed over both API servers"


def _tokens(served: Served) -> float:
    """raydp_generated_tokens_total summed over the API servers (each counts what it served)."""
    by_server: dict[str, float] = {}
    for _ in range(200):  # the servers take turns accepting on the shared port: scrape until both answered
        families = list(text_string_to_metric_families(call(served.address, "GET", "/metrics").body.decode()))
        index = next(s.labels["client_index"] for f in families for s in f.samples if s.name == "raydp_api_server_info")
        by_server[index] = sum(s.value for f in families for s in f.samples if s.name == "raydp_generated_tokens_total")
        if len(by_server) == 2:
            return sum(by_server.values())
    raise AssertionError(f"only API servers {sorted(by_server)} answered /metrics")
