"""Sampling on the wire: validated where built and where decoded; engines that cannot honour a field say so."""

from __future__ import annotations

import pytest

from raydp import Sampling
from raydp.engine.core import EngineContext
from raydp.errors import ConfigError, ProtocolError
from raydp.models.echo import EchoEngine
from raydp.models.tiny_lm import TinyLMEngine
from raydp.wire.codec import encode
from raydp.wire.protocol import Request, request_decoder

pytestmark = pytest.mark.timeout(60)
CTX = EngineContext(0, 0, 1, 1, "node")


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"temperature": -0.1}, "temperature=-0.1"),
        ({"temperature": float("nan")}, "temperature=nan"),
        ({"temperature": True}, "temperature=True"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"top_k": -1}, "top_k=-1"),
        ({"seed": -3}, "seed=-3"),
        ({"stop": ["ok", ""]}, "stop[1]=''"),
        ({"stop": ["x"] * 17}, "stop="),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids[1]=-2"),
        ({"ignore_eos": 1}, "ignore_eos=1"),
    ],
)
def test_a_bad_field_is_refused_naming_the_field_and_the_value(fields: dict[str, object], named: str) -> None:
    with pytest.raises(ConfigError) as info:
        Sampling(**fields)  # type: ignore[arg-type]
    assert str(info.value).startswith(named) and "must be" in str(info.value)


def test_a_request_carries_its_sampling_over_the_wire() -> None:
    sampling = Sampling(temperature=0.8, top_p=0.9, top_k=5, seed=7, stop=["\n\n"], stop_token_ids=[2], ignore_eos=True)
    decoded = request_decoder(encode(Request("r", [1, 2], 4, sampling=sampling)))
    assert decoded.sampling == sampling
    assert request_decoder(encode(Request("g", [1], 4))).sampling is None, "greedy costs no bytes"


def test_a_peer_cannot_smuggle_an_invalid_sampling_past_the_decoder() -> None:
    bad = Request("r", [1], 4, sampling=Sampling())
    body = encode(bad).replace(encode(Sampling()), b"\x91\xcb\xbf\xf0\x00\x00\x00\x00\x00\x00")  # temperature=-1.0
    with pytest.raises(ProtocolError, match="temperature"):
        request_decoder(body)


def test_greedy_is_the_default_and_set_fields_lists_what_differs() -> None:
    assert Sampling().is_greedy() and Sampling().set_fields() == []
    assert Sampling(temperature=0.5, seed=1).set_fields() == ["temperature", "seed"]


@pytest.mark.parametrize("engine", [EchoEngine(CTX), TinyLMEngine(CTX, layers=1, dim=16, heads=2)])
def test_the_reference_engines_refuse_what_they_cannot_honour_naming_it(engine: object) -> None:
    with pytest.raises(ConfigError, match=r"temperature=0\.8: \w+Engine cannot honour it"):
        engine.add_request(Request("r", [1, 2], 4, sampling=Sampling(temperature=0.8)))  # type: ignore[attr-defined]
    engine.add_request(Request("ok", [1, 2], 2, sampling=Sampling(ignore_eos=True)))  # type: ignore[attr-defined]
    assert engine.has_unfinished()  # type: ignore[attr-defined]
