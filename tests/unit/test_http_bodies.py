"""HTTP request bodies: every refusal is a 400 naming the field, the value and what is allowed."""

from __future__ import annotations

import pytest

from raydp.serve.api_errors import ApiError
from raydp.serve.bodies import CompletionBody, GenerateBody, Limits, parse

pytestmark = pytest.mark.timeout(60)


def refusal(body: bytes, model: type[CompletionBody] | type[GenerateBody] = CompletionBody) -> ApiError:
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
        (b'{"prompt": "x", "temperature": 0.5}', "temperature",
         "temperature: unknown field; allowed fields: prompt, model, max_tokens, stream, n, user, rank"),
        (b'{"prompt": "x", "max_tokens": -1}', "max_tokens",
         "max_tokens=-1: Input should be greater than or equal to 1"),
        (b'{"prompt": "x", "max_tokens": 1.0}', "max_tokens", "max_tokens=1.0: Input should be a valid integer"),
        (b'{"prompt": "x", "max_tokens": "5"}', "max_tokens", "max_tokens='5': Input should be a valid integer"),
        (b'{"prompt": "x", "stream": "yes"}', "stream", "stream='yes': Input should be a valid boolean"),
        (b'{"prompt": "x", "n": 2}', "n", "n=2: Input should be 1"),
        (b'{"prompt": [1, -2]}', "prompt[1]", "prompt[1]=-2: Input should be greater than or equal to 0"),
        (b'{"prompt": [1, 2147483648]}', "prompt[1]",
         "prompt[1]=2147483648: Input should be less than or equal to 2147483647"),
        (b'{"prompt": [1, true]}', "prompt[1]", "prompt[1]=True: Input should be a valid integer"),
        (b'{"prompt": 5}', "prompt", "prompt=5: Input should be a string or a list of token ids"),
        (b'{"prompt": ""}', "prompt", "prompt='': String should have at least 1 character"),
        (b'{"max_tokens": 3}', "prompt", "prompt: required"),
    ],
)
def test_each_refusal_names_the_field_the_value_and_what_is_allowed(body: bytes, param: str, message: str) -> None:
    err = refusal(body)
    assert (err.param, err.message) == (param, message)
    assert err.body() == {"error": {"message": message, "type": "invalid_request_error", "param": param,
                                    "code": None}}


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
        (lambda: limits.check_model("other"), 404, "model",
         "model='other': not served here; this server serves 'm'"),
        (lambda: limits.check_max_tokens(101), 400, "max_tokens", "max_tokens=101: must be <= 100 (this server's cap)"),
        (lambda: limits.check_rank(2), 400, "rank", "rank=2: must be in [0, 2) (the cluster's ranks)"),
        (lambda: limits.check_token_ids([1, 256], "prompt"), 400, "prompt[1]",
         "prompt[1]=256: must be in [0, 256) (the vocabulary)"),
    ]
    for check, status, param, message in cases:
        with pytest.raises(ApiError) as info:
            check()
        assert (info.value.status, info.value.param, info.value.message) == (status, param, message)
    limits.check_model(None), limits.check_model("m"), limits.check_max_tokens(100), limits.check_rank(None)
    limits.check_token_ids([0, 255], "prompt")
    Limits(model="m", max_tokens=1, ranks=1).check_token_ids([2**31 - 1], "prompt")  # no vocabulary: any id
