"""vLLM's own messages on raydp's sockets, and the vLLM front-end's pure decisions: no pickle, which streams
can migrate, which of vllm serve's flags raydp refuses."""

from __future__ import annotations

import pytest

from raydp.cli import vllm_flags
from raydp.errors import ConfigError
from raydp.models.vllm.native import NativeCodec, check_no_pickle, typed_args
from raydp.models.vllm.requests import resumed

pytestmark = pytest.mark.timeout(120)


def _request(**params: object) -> object:
    from vllm import SamplingParams
    from vllm.v1.engine import EngineCoreRequest

    return EngineCoreRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        mm_features=None,
        sampling_params=SamplingParams(max_tokens=5, **params),  # type: ignore[arg-type]
        pooling_params=None,
        arrival_time=1.5,
        lora_request=None,
        cache_salt=None,
        data_parallel_rank=None,
    )


def test_a_request_and_an_output_cross_in_vllms_msgpack_unchanged() -> None:
    import numpy as np
    from vllm.v1.engine import EngineCoreOutput, FinishReason
    from vllm.v1.outputs import LogprobsLists

    codec = NativeCodec()
    request = _request(temperature=0.5, seed=3, logprobs=2)
    back = codec.request(codec.encode(request))
    assert (back.request_id, back.prompt_token_ids, back.sampling_params.seed) == ("r1", [1, 2, 3], 3)
    logprobs = LogprobsLists(np.array([[4, 5]]), np.array([[-0.5, -1.5]], dtype=np.float32), np.array([0]))
    out = EngineCoreOutput("r1", [4], new_logprobs=logprobs, finish_reason=FinishReason.LENGTH)
    again = codec.output(codec.encode(out))
    assert (again.new_token_ids, again.finish_reason) == ([4], FinishReason.LENGTH)
    assert again.new_logprobs.logprobs.tolist() == [[-0.5, -1.5]]


def test_a_utility_call_and_its_result_cross_with_structs_rebuilt_by_the_methods_signature() -> None:
    from vllm.lora.request import LoRARequest

    codec = NativeCodec()
    method, args = codec.decode_call(codec.call("add_lora", (LoRARequest("a", 1, "/tmp/a"),)))

    def add_lora(lora_request: LoRARequest) -> bool:
        return isinstance(lora_request, LoRARequest) and lora_request.lora_name == "a"

    add_lora.__annotations__ = {"lora_request": LoRARequest, "return": bool}  # resolved, as vLLM's module has them

    assert method == "add_lora" and add_lora(*typed_args(add_lora, args))
    assert codec.decode_result(codec.result({1, 2})) == [1, 2]  # a set, as vLLM's own client gets it
    with pytest.raises(ConfigError, match="args: 2 given, add_lora takes at most 1"):
        typed_args(add_lora, [1, 2])


def test_what_msgpack_cannot_type_is_refused_not_pickled() -> None:
    codec = NativeCodec()
    with pytest.raises(TypeError, match="not serializable"):
        codec.encode(object())


def test_a_process_that_allows_vllms_pickle_fallback_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    with pytest.raises(ConfigError, match="VLLM_ALLOW_INSECURE_SERIALIZATION='1': raydp never takes pickle"):
        check_no_pickle()
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "0")
    check_no_pickle()


@pytest.mark.parametrize(
    ("params", "why"),
    [
        ({"temperature": 0.0}, None),
        ({"temperature": 0.8}, None),  # unseeded sampling: any continuation is a fair sample
        ({"temperature": 0.0, "seed": 4}, None),  # greedy: the seed changes nothing
        ({"temperature": 0.8, "seed": 4}, "seeded sampling"),
        ({"repetition_penalty": 1.2, "min_tokens": 3}, None),  # over prompt and output alike; min_tokens shrinks
        ({"presence_penalty": 0.5}, "presence and frequency penalties"),  # output tokens only
    ],
)
def test_which_streams_can_resume_on_another_rank(params: dict[str, object], why: str | None) -> None:
    from raydp.serve.vllm_core import migration_blocker

    said = migration_blocker(_request(**params))
    assert (said is None) if why is None else (said is not None and why in said)


def test_a_stream_with_structured_outputs_is_not_resumed() -> None:
    from vllm.sampling_params import StructuredOutputsParams

    from raydp.serve.vllm_core import migration_blocker

    said = migration_blocker(_request(structured_outputs=StructuredOutputsParams(choice=["a", "b"])))
    assert said is not None and "grammar" in said


def test_a_resumed_stream_makes_what_is_left_and_does_not_send_its_prompt_logprobs_twice() -> None:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=10, min_tokens=4, prompt_logprobs=2)
    again = resumed(params, 3)
    assert (again.max_tokens, again.min_tokens, again.prompt_logprobs) == (7, 1, None)
    assert (params.max_tokens, params.min_tokens, params.prompt_logprobs) == (10, 4, 2), "the original is kept"
    assert resumed(SamplingParams(max_tokens=4, min_tokens=1), 9).min_tokens == 0


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (
            ["--data-parallel-size", "2"],
            "--data-parallel-size=2: raydp runs the data parallelism itself; use --dp-size",
        ),
        (["--api-server-count", "3"], "use --api-servers"),
        (["--data-parallel-backend", "ray"], "raydp places the ranks itself"),
        (["--headless"], "--headless=True"),
        (["--data-parallel-address", "10.0.0.1"], "--data-parallel-address='10.0.0.1'"),
    ],
)
def test_vllms_own_data_parallel_flags_are_refused_naming_raydps(flags: list[str], said: str) -> None:
    with pytest.raises(ConfigError, match=said.replace("(", r"\(")):
        vllm_flags.frontend_flags("/m", flags)


def test_front_end_flags_go_to_the_api_servers_and_only_engine_flags_to_the_ranks() -> None:
    flags = ["--served-model-name", "m", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    assert vllm_flags.frontend_flags("/m", flags) == ("--model", "/m", *flags)
    kwargs = vllm_flags.engine_kwargs("/m", [*flags, "--max-model-len", "64"])
    assert kwargs == {"model": "/m", "served_model_name": ["m"], "max_model_len": 64}


def test_the_instant_engine_answers_vllms_request_at_once_in_vllms_output() -> None:
    from vllm.v1.engine import FinishReason

    from raydp.engine.core import EngineContext
    from raydp.models.vllm.instant import InstantVllmEngine
    from raydp.wire.protocol import Request

    codec = NativeCodec()
    engine = InstantVllmEngine(EngineContext(rank=0, local_rank=0, dp_size=1, world_size=1, node_id="n"))
    engine.add_request(Request("r1", [1, 2, 3], 5, native=codec.encode(_request())))
    assert engine.has_unfinished() and engine.load() == (1, 0)
    (out,) = engine.step()
    native = codec.output(out.native)
    assert (out.token_ids, out.finished, native.new_token_ids, native.finish_reason) == (
        [7] * 5,
        True,
        [7] * 5,
        FinishReason.LENGTH,
    )
    assert not engine.has_unfinished() and engine.step() == []
    assert codec.decode_result(engine.vllm_call(codec.call("get_supported_tasks", ()))) == ["generate"]
