"""vLLM's own messages on raydp's sockets: encoded with vLLM's msgpack, never with pickle.

When ``raydp serve --engine vllm`` runs vLLM's own front-end, an API server
sends each rank vLLM's ``EngineCoreRequest`` unchanged (inside a raydp
:class:`~raydp.wire.protocol.Request`, as its ``native`` bytes) and gets each
request's ``EngineCoreOutput`` back the same way; utility calls (``add_lora``,
``reset_prefix_cache``, ``collective_rpc``, ...) travel as ``(method, args)``
and come back as vLLM's ``UtilityResult``. :class:`NativeCodec` is both ends'
encoder and decoders.

raydp's wire rule holds here too: no pickle on a socket that a peer outside
the rank can reach. vLLM's encoder falls back to pickle for types it cannot
encode (and its decoder unpickles) only when ``VLLM_ALLOW_INSECURE_SERIALIZATION``
is set, so :class:`NativeCodec` refuses to exist in a process that sets it;
without it, vLLM's encoder raises ``TypeError`` on such a type, which fails
that request alone. Tensors and arrays are encoded inline (one frame per
message, as raydp's sockets carry them).
"""

from __future__ import annotations

import inspect
import os
import sys
import typing
from collections.abc import Callable
from typing import Any

import msgspec

from raydp.errors import ConfigError, ProtocolError

INSECURE_FLAG = "VLLM_ALLOW_INSECURE_SERIALIZATION"


def check_no_pickle() -> None:
    """ConfigError if this process lets vLLM's msgpack fall back to pickle."""
    value = os.environ.get(INSECURE_FLAG, "0")
    if value.strip() not in ("", "0"):
        raise ConfigError(
            f"{INSECURE_FLAG}={value!r}: raydp never takes pickle from a socket; unset it (or set it to 0) "
            "for raydp's ranks and API servers"
        )


class NativeCodec:
    """vLLM's ``MsgpackEncoder`` and typed ``MsgpackDecoder``s, as one-frame ``bytes``.

    Not thread-safe (vLLM's encoder keeps per-call state): one per thread
    that encodes, e.g. a rank's loop, or an API server's event loop.
    """

    def __init__(self) -> None:
        check_no_pickle()
        from vllm.v1.engine import EngineCoreOutput, EngineCoreRequest
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder, UtilityResult

        self._encoder = MsgpackEncoder(size_threshold=sys.maxsize)  # inline: one frame per message
        self._requests = MsgpackDecoder(EngineCoreRequest)
        self._outputs = MsgpackDecoder(EngineCoreOutput)
        self._calls = MsgpackDecoder(tuple[str, list[Any]])
        self._results = MsgpackDecoder(UtilityResult)
        self._result_type = UtilityResult

    def encode(self, obj: Any) -> bytes:
        """One vLLM message as bytes; ProtocolError for what cannot go in one frame."""
        frames = self._encoder.encode(obj)
        if len(frames) != 1:  # a device tensor: vLLM would send it out of band
            raise ProtocolError(f"{type(obj).__name__}: holds a device tensor, which raydp does not send over a socket")
        return bytes(frames[0])

    def request(self, body: bytes) -> Any:
        return self._requests.decode(body)

    def output(self, body: bytes) -> Any:
        return self._outputs.decode(body)

    def call(self, method: str, args: tuple[Any, ...]) -> bytes:
        return self.encode((method, list(args)))

    def decode_call(self, body: bytes) -> tuple[str, list[Any]]:
        method, args = self._calls.decode(body)
        return str(method), list(args)

    def result(self, value: Any) -> bytes:
        return self.encode(self._result_type(value))

    def decode_result(self, body: bytes) -> Any:
        return self._results.decode(body).result


def typed_args(method: Callable[..., Any], args: list[Any]) -> list[Any]:
    """``args`` with each one that ``method`` annotates as a msgspec Struct built as that Struct.

    Untyped msgpack gives a utility's arguments back as lists and dicts; vLLM's
    engine process converts them by the method's signature, and so does this.
    """
    names = list(inspect.signature(method).parameters)
    if len(args) > len(names):
        raise ConfigError(f"args: {len(args)} given, {method.__name__} takes at most {len(names)}")
    try:
        hints = typing.get_type_hints(method)
    except (NameError, TypeError):  # an annotation that does not resolve: leave those arguments as they came
        hints = {}
    out = []
    for value, name in zip(args, names[: len(args)], strict=True):
        hint = hints.get(name)
        wanted = inspect.isclass(hint) and issubclass(hint, msgspec.Struct) and not isinstance(value, hint)
        out.append(msgspec.convert(value, hint) if wanted else value)
    return out
