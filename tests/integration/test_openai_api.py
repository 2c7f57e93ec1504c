"""The official ``openai`` SDK against a real ``raydp serve`` (mp backend, echo engine, 4 API servers).

The echo engine answers a prompt by cycling through it: prompt [a, b] with
max_tokens=5 gives [a, b, a, b, a]. Text goes through the byte tokenizer
(one token per UTF-8 byte).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.http_helpers import Served, call, health, raydp_serve

NAME = "oai"


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    with raydp_serve("--name", NAME, "--engine", "echo", "--dp-size", "2", "--api-servers", "4") as s:
        yield s


@pytest.fixture(scope="module")
def sdk(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="x", max_retries=0, timeout=30)


def echo(prompt: list[int], max_tokens: int) -> list[int]:
    return [prompt[i % len(prompt)] for i in range(max_tokens)]


@pytest.mark.timeout(120)
def test_a_token_id_prompt_is_completed_in_openais_shape(sdk: openai.OpenAI) -> None:
    done = sdk.completions.create(model=NAME, prompt=[104, 105], max_tokens=5, user="alice")
    assert done.object == "text_completion" and done.model == NAME and done.id.startswith("cmpl-")
    assert isinstance(done.created, int) and abs(done.created - time.time()) < 60
    [choice] = done.choices
    assert (choice.text, choice.index, choice.logprobs, choice.finish_reason) == ("hihih", 0, None, "length")
    extra = choice.model_extra or {}
    assert extra["token_ids"] == [104, 105, 104, 105, 104], "the ids, a raydp extension"
    assert extra["rank"] in (0, 1), "the rank that served it, a raydp extension"
    assert done.usage is not None
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == (2, 5, 7)


@pytest.mark.timeout(120)
def test_a_string_prompt_goes_through_the_byte_tokenizer(sdk: openai.OpenAI) -> None:
    done = sdk.completions.create(model=NAME, prompt="raydp", max_tokens=7)
    assert done.choices[0].text == "raydpra"
    assert done.usage is not None and done.usage.prompt_tokens == 5
    # "é" is two bytes; three tokens end inside a second "é": it decodes as U+FFFD.
    done = sdk.completions.create(model=NAME, prompt="é", max_tokens=3)
    assert (done.choices[0].model_extra or {})["token_ids"] == [0xC3, 0xA9, 0xC3]
    assert done.choices[0].text == "é\ufffd"


@pytest.mark.timeout(120)
def test_a_pinned_rank_serves_the_request(sdk: openai.OpenAI) -> None:
    for rank in (0, 1, 1, 0):
        done = sdk.completions.create(model=NAME, prompt=[7], max_tokens=2, extra_body={"rank": rank})
        assert (done.choices[0].model_extra or {})["rank"] == rank


@pytest.mark.timeout(120)
def test_a_streamed_completion_arrives_chunk_by_chunk_then_a_finish_reason(sdk: openai.OpenAI) -> None:
    chunks = list(sdk.completions.create(model=NAME, prompt="héllo", max_tokens=9, stream=True))
    assert len(chunks) >= 2 and len({c.id for c in chunks}) == 1
    assert all(c.object == "text_completion" and c.model == NAME for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks) == "héllohé", "a character split over chunks comes out whole"
    ids = [t for c in chunks for t in (c.choices[0].model_extra or {})["token_ids"]]
    assert ids == echo(list("héllo".encode()), 9)


@pytest.mark.timeout(120)
def test_the_stream_is_server_sent_events_ending_with_done(served: Served) -> None:
    answer = call(served.address, "POST", "/v1/completions", {"prompt": [65, 66], "max_tokens": 3, "stream": True})
    assert answer.status == 200 and answer.headers["content-type"].startswith("text/event-stream")
    events = answer.body.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], "a [DONE] event, then nothing"
    assert all(e.startswith("data: {") for e in events[:-2])
    assert '"finish_reason":"length"' in events[-3]


@pytest.mark.timeout(120)
def test_models_lists_the_one_model_served(sdk: openai.OpenAI) -> None:
    assert [(m.id, m.object, m.owned_by) for m in sdk.models.list()] == [(NAME, "model", "raydp")]


@pytest.mark.timeout(180)
def test_four_api_servers_share_one_port(served: Served, sdk: openai.OpenAI) -> None:
    seen: set[int] = set()
    deadline = time.monotonic() + 60
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        while len(seen) < 4 and time.monotonic() < deadline:
            answers = list(pool.map(lambda _: health(served.address), range(16)))
            assert {(h["status"], h["client_count"]) for h in answers} == {("ok", 4)}
            seen |= {h["client_index"] for h in answers}
        assert seen == {0, 1, 2, 3}, "every process accepts on the one socket"

        def complete(i: int) -> list[int]:
            done = sdk.completions.create(model=NAME, prompt=[i, i + 1], max_tokens=3)
            return list((done.choices[0].model_extra or {})["token_ids"])

        assert list(pool.map(complete, range(64))) == [echo([i, i + 1], 3) for i in range(64)]
    assert len(served.api_server_pids()) == 4


@pytest.mark.timeout(120)
def test_errors_reach_the_sdk_in_openais_shape(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model=NAME, prompt="x", max_tokens=2, frequency_penalty=0.5)
    assert bad.value.param == "frequency_penalty" and "unknown field" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model=NAME, prompt=[1, 2**31], max_tokens=2)
    assert bad.value.param == "prompt[1]" and "prompt[1]=2147483648" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model=NAME, prompt="x", max_tokens=10**12)
    assert bad.value.param == "max_tokens" and "max_tokens=1000000000000: must be <=" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.completions.create(model=NAME, prompt="x", extra_body={"rank": 2})
    assert bad.value.param == "rank" and "rank=2: must be in [0, 2)" in bad.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.completions.create(model="gpt-4", prompt="x")
    assert missing.value.code == "model_not_found" and f"serves {NAME!r}" in missing.value.message


@pytest.mark.timeout(180)
def test_metrics_count_exactly_what_one_api_server_served() -> None:
    with raydp_serve("--name", "oaimetrics", "--engine", "echo", "--dp-size", "2", "--api-servers", "1") as s:
        sdk = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=30)
        for n in (1, 2, 3):
            sdk.completions.create(model="oaimetrics", prompt=[9], max_tokens=n)
        list(sdk.completions.create(model="oaimetrics", prompt=[9], max_tokens=4, stream=True))
        for _ in range(2):
            with pytest.raises(openai.BadRequestError):
                sdk.completions.create(model="oaimetrics", prompt=[9], max_tokens=0)
        assert call(s.address, "POST", "/v1/generate", {"prompt_token_ids": [1], "max_tokens": 5}).status == 200
        assert call(s.address, "GET", "/nope").status == 404
        assert call(s.address, "GET", "/v1/completions").status == 405
        health(s.address)
        # The load gauges follow the coordinator's snapshots, a moment behind: scrape until idle.
        scrapes, busy = 0, True
        while busy and scrapes < 100:
            answer = call(s.address, "GET", "/metrics")
            scrapes += 1
            assert answer.status == 200 and answer.headers["content-type"].startswith("text/plain")
            samples = {
                (m.name, tuple(sorted(x.labels.items())), x.name): x.value
                for m in text_string_to_metric_families(answer.body.decode())
                for x in m.samples
            }
            busy = any(v for k, v in samples.items() if k[0] in ("raydp_rank_running", "raydp_rank_waiting"))
            time.sleep(0.1 if busy else 0)
    requests = {
        (dict(k[1])["route"], dict(k[1])["status"]): v
        for k, v in samples.items()
        if k[2] == "raydp_http_requests_total"
    }
    expected = {
        ("/v1/completions", "200"): 4,
        ("/v1/completions", "400"): 2,
        ("/v1/generate", "200"): 1,
        ("other", "404"): 1,
        ("/v1/completions", "405"): 1,
        ("/health", "200"): 1,
    }
    if scrapes > 1:
        expected[("/metrics", "200")] = scrapes - 1
    assert requests == expected, "every answer so far, the earlier scrapes included, this one not yet"
    assert samples[("raydp_generated_tokens", (), "raydp_generated_tokens_total")] == 1 + 2 + 3 + 4 + 5
    assert samples[("raydp_time_to_first_token_seconds", (), "raydp_time_to_first_token_seconds_count")] == 5
    latency = (
        "raydp_http_request_duration_seconds",
        (("route", "/v1/completions"),),
        "raydp_http_request_duration_seconds_count",
    )
    assert samples[latency] == 7
    for rank in ("0", "1"):
        assert samples[("raydp_rank_waiting", (("rank", rank),), "raydp_rank_waiting")] == 0
        assert samples[("raydp_rank_running", (("rank", rank),), "raydp_rank_running")] == 0
        assert samples[("raydp_rank_dead", (("rank", rank),), "raydp_rank_dead")] == 0
        assert samples[("raydp_rank_work", (("rank", rank),), "raydp_rank_work")] == 0  # echo reports work()
    info = ("raydp_api_server_info", (("client_count", "1"), ("client_index", "0")), "raydp_api_server_info")
    assert samples[info] == 1
