"""The reference LM: greedy outputs do not depend on what a request is batched with."""

from __future__ import annotations

import pytest

from raydp.engine.core import EngineContext
from raydp.models.tiny_lm import TinyLMEngine
from raydp.wire.protocol import Request

pytestmark = pytest.mark.timeout(60)


def _run(engine: TinyLMEngine, requests: list[Request]) -> dict[str, list[int]]:
    for request in requests:
        engine.add_request(request)
    got: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.token_ids)
    return got


def _engine() -> TinyLMEngine:
    return TinyLMEngine(EngineContext(0, 0, 1, 1, "n"), max_running=8)


def test_batched_and_solo_generation_agree() -> None:
    prompts = {f"p{i}": [(7 * i + k) % 256 for k in range(1 + i % 5)] for i in range(24)}
    solo = {rid: _run(_engine(), [Request(rid, p, 12)])[rid] for rid, p in prompts.items()}
    # Several prompt lengths in one batch, and later requests admitted while others run.
    batched = _run(_engine(), [Request(rid, p, 12) for rid, p in prompts.items()])
    assert batched == solo
    assert all(len(tokens) == 12 for tokens in solo.values())
    assert len({tuple(t) for t in solo.values()}) > 1, "different prompts give different outputs"


def test_work_counts_the_tokens_left_to_generate_waiting_and_running() -> None:
    engine = TinyLMEngine(EngineContext(0, 0, 1, 1, "n"), max_running=1)
    engine.add_request(Request("a", [1, 2], 3))
    engine.add_request(Request("b", [3], 5))
    assert engine.work() == 8
    engine.step()  # a runs, b waits
    assert engine.work() == 7
    while engine.has_unfinished():
        engine.step()
    assert engine.work() == 0


def test_a_continuation_from_prompt_plus_streamed_tokens_gives_the_rest_of_the_answer() -> None:
    """What stream migration relies on: greedy decoding resumed from any point gives the same tokens."""
    whole = _run(_engine(), [Request("a", [3, 1, 4, 1, 5], 20)])["a"]
    rest = _run(_engine(), [Request("b", [3, 1, 4, 1, 5, *whole[:7]], 13)])["b"]
    assert rest == whole[7:]


def test_a_negative_step_delay_is_refused_naming_the_field() -> None:
    from raydp.errors import ConfigError

    with pytest.raises(ConfigError, match="step_delay_s=-1"):
        TinyLMEngine(EngineContext(0, 0, 1, 1, "n"), step_delay_s=-1)
