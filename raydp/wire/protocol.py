"""The data path's and the handshake's messages, and their decoders.

Framing per socket:

* engine input (client DEALER -> engine ROUTER): two frames, ``[tag, body]``,
  where ``tag`` is one byte from :class:`RequestType` (one request, a batch
  of requests, an abort, a utility call);
* engine output (engine ROUTER -> client DEALER): one :class:`OutputBatch`;
* handshake (engine DEALER -> front-end ROUTER): one :data:`HandshakeMessage`.

The coordinator's sockets carry :mod:`raydp.wire.control`'s messages; the base
struct, the encoder and the decoder type are in :mod:`raydp.wire.codec`.
"""

from __future__ import annotations

import enum
from typing import Any, Final, Union

from raydp.errors import ProtocolError
from raydp.wire.codec import Decoder, PeerWave, WireMessage
from raydp.wire.sampling import Sampling


class RequestType(bytes, enum.Enum):
    """One-byte tags on engine input frames."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    ADD_MANY = b"\x03"


# ---- client -> engine ------------------------------------------------------------


MAX_TOKEN_ID: Final = 2**31 - 1  # token ids and max_tokens fit an int32 on every engine


class Request(WireMessage, gc=False):
    """A request for one engine. ``wave`` is the sender's view of the current wave.

    ``seq`` numbers the client's submissions. The engine echoes it in every
    :class:`Output`, so that once an id is aborted and submitted again, a late
    output of the first submission cannot join the second one's answer.
    ``sampling`` None decodes greedily (see :mod:`raydp.wire.sampling`).

    ``native`` carries the engine's own encoding of the request when the
    front-end speaks the engine's language (vLLM's ``EngineCoreRequest`` in
    vLLM's msgpack, see :mod:`raydp.models.vllm.native`); the fields above
    still say what routing, load booking and migration need: the prompt, and
    the token budget. A migrated native request keeps its ``native`` bytes and
    carries the streamed tokens at the end of ``prompt_token_ids``.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int = 16
    wave: PeerWave = 0
    arrival_time: float = 0.0
    seq: int = 0
    sampling: Sampling | None = None
    native: bytes | None = None
    adapter: str = ""  # the LoRA adapter it runs with ("": the base model); routing prefers its holders
    # P/D: run the prompt and make the first token only; the client then moves the request to a decode
    # rank, which takes the prompt's KV through the engines' KV connector (raydp.client.pools).
    prefill_only: bool = False
    prefilled: int = 0  # P/D: the first this many prompt tokens were computed by a prefill rank (0: none)


class RequestBatch(WireMessage, gc=False):
    """Several requests for one engine in one message (``Client.submit_many``)."""

    requests: list[Request]


class Abort(WireMessage):
    request_ids: list[str]


# The utility every engine loop answers with where the coordinator is, once it moved to another
# node (msgpack builtins of a CoordinatorEndpoints; None before): clients that hear nothing from
# their coordinator ask an engine.
COORDINATOR_UTILITY = "raydp_coordinator"


class UtilityCall(WireMessage):
    """Call a method of the user's engine by name; arguments must be msgpack-native."""

    call_id: int
    method: str
    args: list[Any] = []


# ---- engine -> client -------------------------------------------------------------


class Output(WireMessage, gc=False):
    """New tokens of one request. ``error`` set means the request failed.

    ``seq`` is the :attr:`Request.seq` it answers; the engine loop sets it, the
    user's engine need not. ``native`` is the engine's own encoding of the
    same output, for a request that came with :attr:`Request.native`.
    """

    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    seq: int = 0
    native: bytes | None = None


class UtilityResult(WireMessage):
    call_id: int
    result: Any = None
    error: str | None = None


class OutputBatch(WireMessage):
    """What one engine step produced for one client."""

    rank: int
    outputs: list[Output] = []
    utility: UtilityResult | None = None


# ---- handshake -------------------------------------------------------------------------


class Hello(WireMessage, tag=1):
    """An engine's first message; ``local``: it runs on the front-end's node."""

    local: bool


class EngineAddresses(WireMessage):
    """Where an engine connects for coordination."""

    coordinator_collect: str
    coordinator_broadcast: str


class ParallelConfig(WireMessage):
    dp_size: int
    world_size: int
    lockstep: bool
    allreduce_interval: int
    dp_master: str = ""
    stats_interval_s: float = 0.1
    wave: int = 0  # a rank added to a running lockstep cluster starts in the current wave


class Init(WireMessage, tag=2):
    addresses: EngineAddresses
    parallel: ParallelConfig


class Ready(WireMessage, tag=3):
    capacity: int
    config_hash: str
    input_addresses: list[str]


class Reject(WireMessage, tag=4):
    """The front-end refused this engine; ``reason`` says why."""

    reason: str


HandshakeMessage = Union[Hello, Init, Ready, Reject]

# ---- decoders ---------------------------------------------------------------------------

request_decoder: Final = Decoder[Request](Request, "request")
request_batch_decoder: Final = Decoder[RequestBatch](RequestBatch, "request batch")
abort_decoder: Final = Decoder[Abort](Abort, "abort")
utility_decoder: Final = Decoder[UtilityCall](UtilityCall, "utility")
output_decoder: Final = Decoder[OutputBatch](OutputBatch, "output")
handshake_decoder: Final = Decoder[HandshakeMessage](HandshakeMessage, "handshake")


def decode_input(tag: bytes, body: bytes) -> Request | RequestBatch | Abort | UtilityCall:
    """Decode one engine-input message by its one-byte tag."""
    if tag == RequestType.ADD.value:
        return request_decoder(body)
    if tag == RequestType.ADD_MANY.value:
        return request_batch_decoder(body)
    if tag == RequestType.ABORT.value:
        return abort_decoder(body)
    if tag == RequestType.UTILITY.value:
        return utility_decoder(body)
    shown = f"{tag[:4]!r}... ({len(tag)} bytes)" if len(tag) > 4 else repr(tag)  # a tag frame may be megabytes
    raise ProtocolError(f"unknown request type tag {shown}; allowed: 0x00, 0x01, 0x02, 0x03")


def rank_identity(rank: int) -> bytes:
    """The handshake DEALER identity of an engine: its rank, 2 bytes little endian."""
    if not 0 <= rank < 1 << 16:
        raise ProtocolError(f"rank={rank}: must be in [0, 65536) to fit a 2-byte identity")
    return rank.to_bytes(2, "little")


def identity_rank(identity: bytes) -> int:
    if len(identity) != 2:
        raise ProtocolError(f"engine identity must be 2 bytes, got {len(identity)}")
    return int.from_bytes(identity, "little")
