"""How a request wants its tokens chosen: the standard sampling fields, typed and validated.

:class:`Sampling` travels inside a :class:`~raydp.wire.protocol.Request`. A
request without one (``sampling=None``, the default) decodes greedily: the
fast path of the reference engines, and what :meth:`Sampling.is_greedy` says
of a default ``Sampling()``.

Validation runs in ``__post_init__``, so it runs both where a caller builds
one (raising :class:`~raydp.errors.ConfigError` naming the field, the value
and what is allowed) and where an engine decodes one off the wire (msgspec
turns the same error into a decode error, which the engine logs and drops).

Engines that cannot honour a field (the reference engines decode greedily)
reject a request that sets it, with :func:`unsupported`'s message, rather
than ignoring it.
"""

from __future__ import annotations

import math
from typing import Final

from raydp.errors import ConfigError
from raydp.wire.codec import WireMessage

MAX_SEED: Final = 2**63 - 1
MAX_STOPS: Final = 16  # OpenAI allows 4; vLLM any number: a bound, so a peer cannot make the check unbounded
MAX_STOP_CHARS: Final = 1024
_MAX_TOKEN_ID: Final = 2**31 - 1  # as wire.protocol.MAX_TOKEN_ID (imported from there would be a cycle)


class Sampling(WireMessage, gc=False):
    """The sampling fields of one request, as vLLM and OpenAI name them.

    * ``temperature``: 0 is greedy; in [0, 100].
    * ``top_p``: the nucleus, in (0, 1]; ``top_k``: the k most likely tokens, 0 for all.
    * ``seed``: makes a sampled request reproducible (same seed, same tokens).
    * ``stop``: strings that end the request (the text up to, not including, the
      first one is returned); ``stop_token_ids``: tokens that end it (returned).
    * ``ignore_eos``: keep generating past the end-of-sequence token until ``max_tokens``.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _check_number("temperature", self.temperature, 0.0, 100.0, "a number in [0, 100]; 0 is greedy")
        _check_number("top_p", self.top_p, 0.0, 1.0, "a number in (0, 1]")
        if self.top_p <= 0.0:
            raise ConfigError(f"top_p={self.top_p!r}: must be a number in (0, 1]")
        _check_int("top_k", self.top_k, 0, _MAX_TOKEN_ID, "an int >= 0 (0: every token)")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED, f"an int in [0, {MAX_SEED}] or None")
        _check_stops(self.stop)
        for i, token in enumerate(self.stop_token_ids):
            _check_int(f"stop_token_ids[{i}]", token, 0, _MAX_TOKEN_ID, f"an int in [0, {_MAX_TOKEN_ID}]")
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(f"ignore_eos={self.ignore_eos!r}: must be a bool")

    def is_greedy(self) -> bool:
        """True when this asks for nothing beyond greedy decoding to ``max_tokens``."""
        return (
            self.temperature == 0.0
            and self.top_p == 1.0
            and self.top_k == 0
            and self.seed is None
            and not self.stop
            and not self.stop_token_ids
            and not self.ignore_eos
        )

    def set_fields(self) -> list[str]:
        """The names of the fields that differ from greedy decoding, in declaration order."""
        default = _GREEDY
        return [name for name in self.__struct_fields__ if getattr(self, name) != getattr(default, name)]


def unsupported(engine: str, sampling: Sampling | None, allowed: tuple[str, ...] = ()) -> str | None:
    """Why ``engine`` cannot serve ``sampling`` (the first field it cannot honour), or None."""
    if sampling is None:
        return None
    for name in sampling.set_fields():
        if name not in allowed:
            value = getattr(sampling, name)
            return (
                f"{name}={value!r}: {engine} cannot honour it (it decodes greedily; "
                f"allowed: {', '.join(allowed) or 'none of the sampling fields'})"
            )
    return None


def _check_number(name: str, value: object, low: float, high: float, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{name}={value!r}: must be {allowed}")
    if not low <= value <= high:
        raise ConfigError(f"{name}={value!r}: must be {allowed}")


def _check_int(name: str, value: object, low: int, high: int, allowed: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ConfigError(f"{name}={value!r}: must be {allowed}")


def _check_stops(stops: object) -> None:
    if not isinstance(stops, list) or len(stops) > MAX_STOPS:
        raise ConfigError(f"stop={stops!r}: must be a list of at most {MAX_STOPS} strings")
    for i, stop in enumerate(stops):
        if not isinstance(stop, str) or not 1 <= len(stop) <= MAX_STOP_CHARS:
            raise ConfigError(f"stop[{i}]={stop!r}: must be a non-empty string of at most {MAX_STOP_CHARS} chars")


_GREEDY: Final = Sampling()  # after the checks it runs are defined
