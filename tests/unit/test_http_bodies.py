"""HTTP request bodies: every refusal is a 400 naming the field, the value and what is allowed."""

from __future__ import annotations

import pytest

from raydp.serve.api_errors import ApiError
from raydp.serve.bodies import ChatBody, CompletionBody, GenerateBody, Limits, parse
from raydp.wire.sampling import Sampling

pytestmark = pytest.mark.timeout(60)


def refusal(
    body: bytes, model: type[CompletionBody] | type[GenerateBody] | type[ChatBody] = CompletionBody
) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(model, body)
    assert info.value.status == 400
    return info.value


def test_a_valid_completion_body_parses_with_openai_defaults() -> None:
    body = parse(CompletionBody, b'{"prompt": "hi", "model": "m", "user": "u", "stream": true, "rank": 1}')
    assert (body.prompt, body.model, body.max_tokens, body.stream, body.n, body.rank) == ("hi", "m", 16, True, 1, 1)
    assert parse(CompletionBody, b'{"prompt": [1, 2], "max_tokens": 3}').prompt == [1, 2]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            b'{"prompt": "x", "frequency_penalty": 0.5}',
            "frequency_penalty",
            "frequency_penalty: unknown field; allowed fields: model, stream, stream_options, n, user, rank, "
            "temperature, top_p, top_k, seed, stop, stop_token_ids, ignore_eos, prompt, max_tokens",
        ),
        (
            b'{"prompt": "x", "max_tokens": -1}',
            "max_tokens",
            "max_tokens=-1: Input should be greater than or equal to 1",
        ),
        (b'{"prompt": "x", "max_tokens": 1.0}', "max_tokens", "max_tokens=1.0: Input should be a valid integer"),
        (b'{"prompt": "x", "max_tokens": "5"}', "max_tokens", "max_tokens='5': Input should be a valid integer"),
        (b'{"prompt": "x", "stream": "yes"}', "stream", "stream='yes': Input should be a valid boolean"),
        (b'{"prompt": "x", "n": 2}', "n", "n=2: Input should be 1"),
        (b'{"prompt": [1, -2]}', "prompt[1]", "prompt[1]=-2: Input should be greater than or equal to 0"),
        (
            b'{"prompt": [1, 2147483648]}',
            "prompt[1]",
            "prompt[1]=2147483648: Input should be less than or equal to 2147483647",
        ),
        (b'{"prompt": [1, true]}', "prompt[1]", "prompt[1]=True: Input should be a valid integer"),
        (b'{"prompt": 5}', "prompt", "prompt=5: Input should be a string or a list of token ids"),
        (b'{"prompt": ""}', "prompt", "prompt='': String should have at least 1 character"),
        (b'{"max_tokens": 3}', "prompt", "prompt: required"),
    ],
)
def test_each_refusal_names_the_field_the_value_and_what_is_allowed(body: bytes, param: str, message: str) -> None:
    err = refusal(body)
    assert (err.param, err.message) == (param, message)
    assert err.body() == {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}


def test_malformed_json_and_a_non_object_are_refused_without_a_field() -> None:
    err = refusal(b'{"prompt": ')
    assert err.param is None and err.code == "invalid_json"
    assert err.message.startswith("request body: not valid JSON (")
    err = refusal(b"[1, 2]")
    assert (err.param, err.message) == (None, "request body=[1, 2]: must be a JSON object")


def test_a_long_value_is_shortened_in_the_message() -> None:
    err = refusal(b'{"prompt_token_ids": "' + b"x" * 500 + b'"}', GenerateBody)
    assert err.param == "prompt_token_ids" and len(err.message) < 200 and "..." in err.message


def test_server_limits_name_the_field_and_the_limit() -> None:
    limits = Limits(model="m", max_tokens=100, ranks=2, vocab_size=256)
    cases = [
        (lambda: limits.check_model("other"), 404, "model", "model='other': not served here; this server serves 'm'"),
        (lambda: limits.check_max_tokens(101), 400, "max_tokens", "max_tokens=101: must be <= 100 (this server's cap)"),
        (lambda: limits.check_rank(2), 400, "rank", "rank=2: must be in [0, 2) (the cluster's ranks)"),
        (
            lambda: limits.check_token_ids([1, 256], "prompt"),
            400,
            "prompt[1]",
            "prompt[1]=256: must be in [0, 256) (the vocabulary)",
        ),
    ]
    for check, status, param, message in cases:
        with pytest.raises(ApiError) as info:
            check()
        assert (info.value.status, info.value.param, info.value.message) == (status, param, message)
    limits.check_model(None), limits.check_model("m"), limits.check_max_tokens(100), limits.check_rank(None)
    limits.check_token_ids([0, 255], "prompt")
    Limits(model="m", max_tokens=1, ranks=1).check_token_ids([2**31 - 1], "prompt")  # no vocabulary: any id


# ---- sampling fields, completions and chat ------------------------------------------------------------------


def test_sampling_fields_become_the_engines_sampling_and_stop_strings_stay_in_the_server() -> None:
    body = parse(
        CompletionBody,
        b'{"prompt": "x", "temperature": 1, "top_p": 0.5, "top_k": 5, "seed": 7, '
        b'"stop": "END", "stop_token_ids": [2, 3], "ignore_eos": true}',
    )
    assert body.sampling() == Sampling(
        temperature=1.0, top_p=0.5, top_k=5, seed=7, stop_token_ids=[2, 3], ignore_eos=True
    ), "no stop strings: the API server applies those"
    assert body.stops() == ["END"]
    assert parse(CompletionBody, b'{"prompt": "x", "stop": ["a", "b"]}').stops() == ["a", "b"]
    assert parse(CompletionBody, b'{"prompt": "x", "top_k": -1}').sampling() is None, "vLLM's -1: every token"
    assert parse(CompletionBody, b'{"prompt": "x", "stop": "a"}').sampling() is None, "stop alone: greedy"
    assert parse(CompletionBody, b'{"prompt": "x", "temperature": 0}').sampling() is None
    none = parse(CompletionBody, b'{"prompt": "x"}')
    assert (none.sampling(), none.stops(), none.include_usage()) == (None, [], False)


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            b'{"prompt": "x", "temperature": -1}',
            "temperature",
            "temperature=-1.0: must be a number in [0, 100]; 0 is greedy",
        ),
        (b'{"prompt": "x", "temperature": "hot"}', "temperature", "temperature='hot': Input should be a valid number"),
        (b'{"prompt": "x", "top_p": 0}', "top_p", "top_p=0.0: must be a number in (0, 1]"),
        (b'{"prompt": "x", "top_k": -2}', "top_k", "top_k=-2: must be an int >= 0 (0: every token)"),
        (b'{"prompt": "x", "seed": -1}', "seed", "seed=-1: must be an int in [0, 9223372036854775807] or None"),
        (b'{"prompt": "x", "stop": 5}', "stop", "stop=5: Input should be a string or a list of at most 16 strings"),
        (b'{"prompt": "x", "stop": ""}', "stop", "stop='': String should have at least 1 character"),
        (b'{"prompt": "x", "stop": ["a", 1]}', "stop[1]", "stop[1]=1: Input should be a valid string"),
        (
            b'{"prompt": "x", "stop_token_ids": [1, -1]}',
            "stop_token_ids[1]",
            "stop_token_ids[1]=-1: Input should be greater than or equal to 0",
        ),
        (b'{"prompt": "x", "ignore_eos": 1}', "ignore_eos", "ignore_eos=1: Input should be a valid boolean"),
        (
            b'{"prompt": "x", "stream_options": {"include_usage": true, "x": 1}}',
            "stream_options.x",
            "stream_options.x: unknown field; allowed fields: include_usage",
        ),
    ],
)
def test_each_bad_sampling_field_is_a_400_naming_it(body: bytes, param: str, message: str) -> None:
    with pytest.raises(ApiError) as info:
        parse(CompletionBody, body).sampling()
    assert (info.value.status, info.value.param, info.value.message) == (400, param, message)


def test_a_stop_list_is_bounded_like_the_wire() -> None:
    err = refusal(b'{"prompt": "x", "stop": [' + b",".join([b'"s"'] * 17) + b"]}")
    assert err.param == "stop" and "List should have at most 16 items" in err.message
    err = refusal(b'{"prompt": "x", "stop": "' + b"s" * 1025 + b'"}')
    assert err.param == "stop" and "at most 1024 characters" in err.message


def test_stream_options_ask_for_a_usage_chunk_and_only_in_a_stream() -> None:
    assert parse(
        CompletionBody, b'{"prompt": "x", "stream": true, "stream_options": {"include_usage": true}}'
    ).include_usage()
    with pytest.raises(ApiError) as info:
        parse(CompletionBody, b'{"prompt": "x", "stream_options": {"include_usage": true}}').include_usage()
    assert (info.value.param, info.value.message) == (
        "stream_options",
        "stream_options={'include_usage': True}: allowed only with stream=true",
    )


def test_a_chat_body_takes_messages_and_either_name_of_max_tokens() -> None:
    body = parse(
        ChatBody,
        b'{"messages": [{"role": "system", "content": "Be brief."}, '
        b'{"role": "user", "content": "hi"}], "stop": ["x"], "stream": true}',
    )
    assert [(m.role, m.content) for m in body.messages] == [("system", "Be brief."), ("user", "hi")]
    assert (body.max_new_tokens(100), body.stops(), body.stream) == (100, ["x"], True), "no max: the server's cap"
    assert parse(ChatBody, b'{"messages": [{"role": "user", "content": ""}], "max_tokens": 5}').max_new_tokens(9) == 5
    both = parse(
        ChatBody, b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "max_completion_tokens": 7}'
    )
    assert both.max_new_tokens(9) == 7, "OpenAI's newer name wins"


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (b'{"messages": []}', "messages", "messages=[]: List should have at least 1 item after validation, not 0"),
        (b"{}", "messages", "messages: required"),
        (
            b'{"messages": [{"role": "tool", "content": "x"}]}',
            "messages[0].role",
            "messages[0].role='tool': Input should be 'system', 'user' or 'assistant'",
        ),
        (b'{"messages": [{"role": "user"}]}', "messages[0].content", "messages[0].content: required"),
        (
            b'{"messages": [{"role": "user", "content": "x", "name": "a"}]}',
            "messages[0].name",
            "messages[0].name: unknown field; allowed fields: role, content",
        ),
        (
            b'{"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}',
            "max_completion_tokens",
            "max_completion_tokens=0: Input should be greater than or equal to 1",
        ),
        (b'{"messages": [{"role": "user", "content": "x"}], "n": 2}', "n", "n=2: Input should be 1"),
    ],
)
def test_each_chat_refusal_names_the_field(body: bytes, param: str, message: str) -> None:
    err = refusal(body, ChatBody)
    assert (err.param, err.message) == (param, message)
