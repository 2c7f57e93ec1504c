"""The base of every wire message, the one shared encoder, typed decoders, and the bounds on a peer's integers.

Only msgpack crosses a socket, never pickle. Decoding anything else raises
:class:`~raydp.errors.ProtocolError`. The messages themselves are in
:mod:`raydp.wire.protocol` (the data path and the handshake) and
:mod:`raydp.wire.control` (to and from the coordinator).
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Generic, TypeVar

import msgspec

from raydp.errors import ProtocolError


class WireMessage(msgspec.Struct, array_like=True, omit_defaults=True, forbid_unknown_fields=True):
    """Base of every wire message: compact positional encoding."""


# What a peer may claim, so that acting on it can neither overflow an encoder nor
# allocate per rank without end: a wave fits an int64 (it counts up by one, so the
# next one still encodes), and a rank count fits the 2-byte engine identity.
MAX_WAVE: Final = 2**63 - 1
MAX_RANKS: Final = 1 << 16
PeerWave = Annotated[int, msgspec.Meta(le=MAX_WAVE)]
RankCount = Annotated[int, msgspec.Meta(le=MAX_RANKS)]

T = TypeVar("T")
_encoder: Final = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    """Encode any wire message (one shared encoder)."""
    return _encoder.encode(msg)


class Decoder(Generic[T]):
    """A typed, reused decoder that raises :class:`ProtocolError` on bad input."""

    __slots__ = ("_decoder", "_what")

    def __init__(self, type: Any, what: str) -> None:
        self._decoder: msgspec.msgpack.Decoder[T] = msgspec.msgpack.Decoder(type)
        self._what = what

    def __call__(self, data: bytes | memoryview) -> T:
        try:
            return self._decoder.decode(data)
        except (msgspec.MsgspecError, ValueError) as exc:  # ValueError: e.g. invalid UTF-8
            raise ProtocolError(f"bad {self._what} message: {exc}") from None
        except RecursionError:
            raise ProtocolError(f"bad {self._what} message: nested too deeply") from None
