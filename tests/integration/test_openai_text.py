"""Text and chat with the official ``openai`` SDK against a real ``raydp serve --tokenizer DIR``.

mp backend, echo engine, 2 ranks, 2 API servers, the tiny checkpoint's
byte-level BPE tokenizer (:func:`raydp.models.checkpoint.make_model`). The
echo engine answers a prompt by cycling through its tokens (prompt [a, b],
max_tokens 5: [a, b, a, b, a]), so every expected text is the tokenizer's
decoding of that cycle; a chat's prompt is the chat template's rendering of
the messages, which the echo replays.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from raydp.text.hf_tokenizer import HFTokenizer
from tests.integration.http_helpers import Served, call, raydp_serve
from tests.integration.vllm_helpers import tiny_model

NAME = "oaitext"
PROMPT = "The quick brown fox jumps over the lazy dog."
EMOJI = "Good morning 🙂, café 🙂!"
MESSAGES: list[Any] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂 there"}]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return tiny_model()  # built once per machine


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> HFTokenizer:
    return HFTokenizer.load(str(model_dir))


@pytest.fixture(scope="module")
def served(model_dir: Path) -> Iterator[Served]:
    with raydp_serve(
        "--name", NAME, "--engine", "echo", "--dp-size", "2", "--api-servers", "2", "--tokenizer", str(model_dir)
    ) as s:
        yield s


@pytest.fixture(scope="module")
def sdk(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0, timeout=60)


def echo(prompt: list[int], max_tokens: int) -> list[int]:
    return [prompt[i % len(prompt)] for i in range(max_tokens)]


def chat_prompt(tok: HFTokenizer) -> list[int]:
    return tok.apply_chat_template(MESSAGES)


def spanning_stop(tok: HFTokenizer, prompt: list[int]) -> tuple[str, int]:
    """A stop string made of the end of one prompt token and the start of the next, and how many
    tokens the echo generates up to the one that completes it."""
    for i in range(len(prompt) - 1):
        first, second = tok.decode(prompt[i : i + 1]), tok.decode(prompt[i + 1 : i + 2])
        stop = first[-1:] + second[:1]
        text = tok.decode(prompt[: i + 2])
        if len(stop) == 2 and first.strip() and text.find(stop) == len(tok.decode(prompt[: i + 1])) - 1:
            return stop, i + 2
    raise AssertionError(f"no stop string spans two tokens of {prompt}")


@pytest.mark.timeout(120)
def test_a_string_prompt_is_encoded_and_the_answer_decoded(sdk: openai.OpenAI, tok: HFTokenizer) -> None:
    ids = tok.encode(PROMPT)
    done = sdk.completions.create(model=NAME, prompt=PROMPT, max_tokens=len(ids) + 3)
    [choice] = done.choices
    assert choice.text == PROMPT + tok.decode(ids[:3]) and choice.finish_reason == "length"
    assert (choice.model_extra or {})["token_ids"] == echo(ids, len(ids) + 3)
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(ids), len(ids) + 3)


@pytest.mark.timeout(120)
def test_a_streamed_completion_ends_with_a_usage_chunk_when_asked(sdk: openai.OpenAI, tok: HFTokenizer) -> None:
    ids = tok.encode(PROMPT)
    chunks = list(
        sdk.completions.create(
            model=NAME, prompt=PROMPT, max_tokens=len(ids), stream=True, stream_options={"include_usage": True}
        )
    )
    *texts, closing, usage = chunks
    assert "".join(c.choices[0].text for c in texts) == PROMPT
    assert [c.choices[0].finish_reason for c in texts] == [None] * len(texts)
    assert closing.choices[0].finish_reason == "length" and closing.usage is None
    assert usage.choices == [] and usage.usage is not None
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens, usage.usage.total_tokens) == (
        len(ids),
        len(ids),
        2 * len(ids),
    )


@pytest.mark.timeout(120)
def test_a_chat_is_answered_in_openais_shape(sdk: openai.OpenAI, tok: HFTokenizer) -> None:
    prompt = chat_prompt(tok)
    done = sdk.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=len(prompt) + 2)
    assert done.object == "chat.completion" and done.model == NAME and done.id.startswith("chatcmpl-")
    [choice] = done.choices
    assert (choice.index, choice.message.role, choice.finish_reason) == (0, "assistant", "length")
    assert choice.message.content == tok.decode(echo(prompt, len(prompt) + 2))
    assert choice.message.content.startswith("<|system|>\nBe brief.\n<|user|>\nHi 🙂 there\n<|assistant|>\n")
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == (
        len(prompt),
        len(prompt) + 2,
        2 * len(prompt) + 2,
    )


@pytest.mark.timeout(120)
def test_a_streamed_chat_starts_with_the_role_and_ends_with_the_reason(sdk: openai.OpenAI, tok: HFTokenizer) -> None:
    prompt = chat_prompt(tok)
    chunks = list(
        sdk.chat.completions.create(
            model=NAME,
            messages=MESSAGES,
            max_completion_tokens=len(prompt),
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    opening, *deltas, closing, usage = chunks
    assert (opening.choices[0].delta.role, opening.choices[0].delta.content) == ("assistant", "")
    contents = [c.choices[0].delta.content for c in deltas]
    assert all(contents) and all("\ufffd" not in text for text in contents if text)
    assert "".join(text or "" for text in contents) == tok.decode(prompt)
    assert [c.choices[0].finish_reason for c in deltas] == [None] * len(deltas)
    assert closing.choices[0].finish_reason == "length" and closing.choices[0].delta.content is None
    assert usage.choices == [] and usage.usage is not None
    assert (usage.usage.prompt_tokens, usage.usage.completion_tokens) == (len(prompt), len(prompt))


@pytest.mark.timeout(120)
def test_an_emoji_split_over_tokens_streams_whole(sdk: openai.OpenAI, tok: HFTokenizer) -> None:
    ids = tok.encode(EMOJI)
    assert len(tok.encode("🙂")) > 1
    chunks = list(sdk.completions.create(model=NAME, prompt=EMOJI, max_tokens=2 * len(ids), stream=True))
    texts = [c.choices[0].text for c in chunks]
    assert "".join(texts) == EMOJI * 2 and not any("\ufffd" in t for t in texts)
    assert "🙂" in texts or any(t.startswith("🙂") for t in texts)
    waiting = [c for c in chunks if (c.choices[0].model_extra or {})["token_ids"] and not c.choices[0].text]
    assert waiting, "the emoji's first byte tokens came with no text: it was not complete yet"


@pytest.mark.timeout(180)
def test_a_stop_string_spanning_two_tokens_ends_the_text_and_the_request(
    served: Served, sdk: openai.OpenAI, tok: HFTokenizer
) -> None:
    ids = tok.encode(PROMPT)
    stop, generated = spanning_stop(tok, ids)
    before = PROMPT[: PROMPT.index(stop)]
    # A max_tokens the echo would take minutes to reach: only the abort ends these requests in time.
    done = sdk.completions.create(model=NAME, prompt=PROMPT, max_tokens=1 << 20, stop=[stop, "never"])
    assert (done.choices[0].text, done.choices[0].finish_reason) == (before, "stop")
    assert (done.choices[0].model_extra or {})["token_ids"] == ids[:generated]
    assert done.usage is not None and done.usage.completion_tokens == generated
    chunks = list(sdk.completions.create(model=NAME, prompt=PROMPT, max_tokens=1 << 20, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == before and chunks[-1].choices[0].finish_reason == "stop"
    prompt = chat_prompt(tok)
    chat_stop = tok.decode(prompt).split("Hi 🙂")[0][-3:] + "Hi"  # ends inside the user's message
    answer = sdk.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=1 << 20, stop=chat_stop)
    assert answer.choices[0].message.content == tok.decode(prompt).split(chat_stop)[0]
    assert answer.choices[0].finish_reason == "stop"
    streamed = list(
        sdk.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=1 << 20, stop=chat_stop, stream=True)
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == answer.choices[0].message.content
    assert streamed[-1].choices[0].finish_reason == "stop"
    deadline = time.monotonic() + 30
    while (running := sum_metric(served, "raydp_rank_running")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running == 0, "every stopped request was aborted on its engine"


@pytest.mark.timeout(120)
def test_bad_sampling_fields_are_400s_naming_the_field(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model=NAME, prompt="x", max_tokens=2, temperature=-1)
    assert bad.value.param == "temperature" and "temperature=-1.0: must be a number in [0, 100]" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2, temperature=-1)
    assert bad.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model=NAME, prompt="x", max_tokens=2, stop=["ok", ""])
    assert bad.value.param == "stop[1]" and "stop[1]='': String should have at least 1 character" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(model=NAME, messages=MESSAGES, stop=["s"] * 17)
    assert bad.value.param == "stop" and "at most 16 items" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.chat.completions.create(model=NAME, messages=[{"role": "tool", "content": "x"}])  # type: ignore[list-item]
    assert bad.value.param == "messages[0].role"
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model=NAME, prompt=[1, 1024], max_tokens=2)
    assert bad.value.param == "prompt[1]" and "must be in [0, 1024) (the vocabulary)" in bad.value.message
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="gpt-4", messages=MESSAGES)


@pytest.mark.timeout(180)
def test_metrics_count_the_tokens_and_the_chat_route(served: Served, sdk: openai.OpenAI, tok: HFTokenizer) -> None:
    before = scrape_every_server(served)
    generated = 0
    for n in (1, 4):
        generated += usage_of(sdk.completions.create(model=NAME, prompt=PROMPT, max_tokens=n))
        generated += usage_of(sdk.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=n))
    list(sdk.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=3, stream=True))
    generated += 3
    after = scrape_every_server(served)

    def total(samples: dict[int, dict[tuple[str, str], float]], key: tuple[str, str]) -> float:
        return sum(s.get(key, 0.0) for s in samples.values())

    tokens = ("raydp_generated_tokens_total", "")
    chats = ("raydp_http_requests_total", "/v1/chat/completions|200")
    assert total(after, tokens) - total(before, tokens) == generated == 1 + 4 + 1 + 4 + 3
    assert total(after, chats) - total(before, chats) == 3


def usage_of(answer: Any) -> int:
    assert answer.usage is not None
    return int(answer.usage.completion_tokens)


def scrape(served: Served) -> tuple[int, dict[tuple[str, str], float]]:
    """One API server's samples by (name, "route|status" or ""), and which server answered."""
    answer = call(served.address, "GET", "/metrics")
    assert answer.status == 200
    samples: dict[tuple[str, str], float] = {}
    index = -1
    for family in text_string_to_metric_families(answer.body.decode()):
        for s in family.samples:
            if s.name == "raydp_api_server_info":
                index = int(s.labels["client_index"])
            label = f"{s.labels['route']}|{s.labels['status']}" if "route" in s.labels and "status" in s.labels else ""
            samples[(s.name, label)] = samples.get((s.name, label), 0.0) + s.value
    return index, samples


def scrape_every_server(served: Served) -> dict[int, dict[tuple[str, str], float]]:
    """The latest samples of each of the 2 API servers (connections land on either; scrape until both answered)."""
    seen: dict[int, dict[tuple[str, str], float]] = {}
    deadline = time.monotonic() + 60
    while len(seen) < 2 and time.monotonic() < deadline:
        index, samples = scrape(served)
        seen[index] = samples
    assert sorted(seen) == [0, 1]
    return seen


def sum_metric(served: Served, name: str) -> float:
    return sum(v for (n, _), v in scrape(served)[1].items() if n == name)


@pytest.mark.timeout(180)
def test_the_byte_tokenizer_serves_no_chat() -> None:
    with raydp_serve("--name", "oaibytes", "--engine", "echo", "--dp-size", "1", "--api-servers", "1") as s:
        sdk = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=30)
        with pytest.raises(openai.BadRequestError) as bad:
            sdk.chat.completions.create(model="oaibytes", messages=MESSAGES, max_tokens=2)
        assert bad.value.code == "chat_template_missing" and "--tokenizer DIR" in bad.value.message
        done = sdk.completions.create(model="oaibytes", prompt="ab", max_tokens=5, stop="ba")
        assert (done.choices[0].text, done.choices[0].finish_reason) == ("a", "stop"), "abab: stop strings apply"
