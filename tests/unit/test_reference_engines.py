"""The request bookkeeping the reference engines share (``raydp.models.reference``), seen through each engine."""

from __future__ import annotations

from typing import Any

import pytest

from raydp.engine.core import EngineContext
from raydp.models.echo import EchoEngine
from raydp.models.reference import ReferenceEngine, fit_prompt
from raydp.models.tiny_lm import TinyLMEngine
from raydp.wire.protocol import Request

pytestmark = pytest.mark.timeout(60)

CTX = EngineContext(0, 0, 1, 1, "n")


def _engines() -> list[ReferenceEngine[Any]]:
    return [EchoEngine(CTX, max_running=1), TinyLMEngine(CTX, max_running=1, layers=1, dim=16, heads=2)]


@pytest.mark.parametrize("engine", _engines(), ids=lambda e: type(e).__name__)
def test_requests_wait_run_and_finish_on_their_budget(engine: ReferenceEngine[Any]) -> None:
    engine.add_request(Request("a", [1, 2], 2))
    engine.add_request(Request("b", [3], 1))
    assert engine.load() == (2, 0) and engine.work() == 3
    first = engine.step()  # one slot: "a" runs, "b" waits
    assert [(o.request_id, o.finished) for o in first] == [("a", False)]
    assert engine.load() == (1, 1) and engine.work() == 2
    second = engine.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in second] == [("a", True, "length")]
    third = engine.step()
    assert [(o.request_id, o.finished) for o in third] == [("b", True)]
    assert not engine.has_unfinished() and engine.load() == (0, 0) and engine.work() == 0


@pytest.mark.parametrize("engine", _engines(), ids=lambda e: type(e).__name__)
def test_abort_drops_waiting_and_running_requests_alike(engine: ReferenceEngine[Any]) -> None:
    engine.add_request(Request("a", [1], 5))
    engine.add_request(Request("b", [2], 5))
    engine.step()
    engine.abort(["a", "b", "unknown"])
    assert not engine.has_unfinished() and engine.step() == []


def test_prompts_wrap_into_the_vocabulary_and_budgets_fit_the_positions_left() -> None:
    assert fit_prompt(Request("r", [257, 3], 100), vocab=256, max_len=8) == ([1, 3], 6)
    assert fit_prompt(Request("r", [], 4), vocab=256, max_len=8) == ([0], 4)
    assert fit_prompt(Request("r", list(range(10)), 4), vocab=256, max_len=8) == ([3, 4, 5, 6, 7, 8, 9], 1)


def _run(engine: ReferenceEngine[Any], request: Request) -> list[int]:
    engine.add_request(request)
    tokens: list[int] = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.token_ids]
    return tokens


@pytest.mark.parametrize("split", [1, 2, 4])
def test_an_echo_prefilled_elsewhere_goes_on_as_the_whole_echo_would(split: int) -> None:
    echo = EchoEngine(EngineContext(0, 0, 1, 1, "n"))
    whole = _run(echo, Request("w", [4, 5, 6], 7))
    first = _run(echo, Request("p", [4, 5, 6], split))
    rest = _run(echo, Request("d", [4, 5, 6, *first], 7 - split, prefilled=3))
    assert whole == [4, 5, 6, 4, 5, 6, 4] and first + rest == whole
