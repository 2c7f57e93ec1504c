"""Every message that crosses a raydp socket, and the reused codecs for them.

Framing per socket:

* engine input (client DEALER -> engine ROUTER): two frames, ``[tag, body]``,
  where ``tag`` is one byte from :class:`RequestType` (one request, a batch
  of requests, an abort, a utility call);
* engine output (engine ROUTER -> client DEALER): one :class:`OutputBatch`;
* coordinator collect (engines and clients PUSH -> PULL): one :data:`ToCoordinator`;
* coordinator publish (PUB -> client SUB): one :class:`StatsSnapshot`;
* coordinator broadcast (XPUB -> engine SUB): ``[topic, body]`` with a
  :data:`ToEngines` body;
* handshake (engine DEALER -> front-end ROUTER): one :data:`HandshakeMessage`.

Only msgpack crosses a socket, never pickle. Decoding anything else raises
:class:`~raydp.errors.ProtocolError`.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, Final, Generic, TypeVar, Union

import msgspec

from raydp.errors import ProtocolError


class RequestType(bytes, enum.Enum):
    """One-byte tags on engine input frames."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    ADD_MANY = b"\x03"


class _Msg(msgspec.Struct, array_like=True, omit_defaults=True, forbid_unknown_fields=True):
    """Base of every wire message: compact positional encoding."""


# ---- client -> engine ------------------------------------------------------------


MAX_TOKEN_ID: Final = 2**31 - 1  # token ids and max_tokens fit an int32 on every engine
# What a peer may claim, so that acting on it can neither overflow an encoder nor
# allocate per rank without end: a wave fits an int64 (it counts up by one, so the
# next one still encodes), and a rank count fits the 2-byte engine identity.
MAX_WAVE: Final = 2**63 - 1
MAX_RANKS: Final = 1 << 16
PeerWave = Annotated[int, msgspec.Meta(le=MAX_WAVE)]
RankCount = Annotated[int, msgspec.Meta(le=MAX_RANKS)]


class Request(_Msg, gc=False):
    """A request for one engine. ``wave`` is the sender's view of the current wave.

    ``seq`` numbers the client's submissions. The engine echoes it in every
    :class:`Output`, so that once an id is aborted and submitted again, a late
    output of the first submission cannot join the second one's answer.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int = 16
    wave: PeerWave = 0
    arrival_time: float = 0.0
    seq: int = 0


class RequestBatch(_Msg, gc=False):
    """Several requests for one engine in one message (``Client.submit_many``)."""

    requests: list[Request]


class Abort(_Msg):
    request_ids: list[str]


class UtilityCall(_Msg):
    """Call a method of the user's engine by name; arguments must be msgpack-native."""

    call_id: int
    method: str
    args: list[Any] = []


# ---- engine -> client -------------------------------------------------------------


class Output(_Msg, gc=False):
    """New tokens of one request. ``error`` set means the request failed.

    ``seq`` is the :attr:`Request.seq` it answers; the engine loop sets it, the
    user's engine need not.
    """

    request_id: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    seq: int = 0


class UtilityResult(_Msg):
    call_id: int
    result: Any = None
    error: str | None = None


class OutputBatch(_Msg):
    """What one engine step produced for one client."""

    rank: int
    outputs: list[Output] = []
    utility: UtilityResult | None = None


# ---- engines and clients -> coordinator ---------------------------------------------


class EngineStats(_Msg, tag=1):
    """An engine's load, sent when it changed; ``work``: tokens it has left to generate (-1: unknown)."""

    rank: int
    waiting: int
    running: int
    work: int = -1


class WaveComplete(_Msg, tag=2):
    """Rank 0: every rank paused at the end of ``wave``."""

    rank: int
    wave: PeerWave


class StartWave(_Msg, tag=3):
    """An engine got a request for a finished wave while paused and started ``wave``."""

    rank: int
    wave: PeerWave


class FirstRequest(_Msg, tag=4):
    """A client sent the first request of a paused cluster to ``rank`` at ``wave``."""

    rank: int
    wave: PeerWave


class ScaleEngines(_Msg, tag=5):
    """The launcher changes the rank count (``cluster.scale``).

    The coordinator tracks ``engine_count`` ranks; clients route new requests
    to the first ``size`` of them (-1: all). A scale-up first grows
    ``engine_count`` (the new ranks may report), then ``size`` once they have
    joined; a scale-down first shrinks ``size`` (the highest ranks drain),
    then ``engine_count`` once they are gone.
    """

    engine_count: RankCount
    size: RankCount = -1


class EngineDead(_Msg, tag=6):
    """The launcher saw ``rank`` die; the coordinator tells every client."""

    rank: int
    cause: str = ""


class EngineRevived(_Msg, tag=7):
    """``rank`` listens at new addresses on ``node_id`` (a restart, or a rank added by a scale-up)."""

    rank: int
    input_addresses: list[str]
    node_id: str = ""


class HoldCluster(_Msg, tag=8):
    """Launcher: bring lockstep ranks ``0..gang-1`` to a wave boundary and keep them there.

    ``epoch`` names the change; ``gang`` is the size of the DP group now.
    """

    epoch: int
    gang: int


class HoldAck(_Msg, tag=9):
    """A held rank's position: its wave and whether it is stepping in it."""

    rank: int
    epoch: int
    wave: PeerWave
    running: bool


class RegroupCluster(_Msg, tag=10):
    """Launcher, once the gang is held: re-form the DP group with ``dp_size`` ranks at ``dp_master``."""

    epoch: int
    dp_size: int
    dp_master: str


class Regrouped(_Msg, tag=11):
    """A rank joined the new DP group of ``epoch`` (or, above its size, left the old one)."""

    rank: int
    epoch: int


class ReleaseCluster(_Msg, tag=12):
    """Launcher: the change is done; ranks may start waves again."""

    epoch: int


class EngineReport(_Msg, tag=13):
    """An engine's whole state, in answer to ``Resync`` from a restarted coordinator.

    ``wave`` and ``stepping`` are the rank's wave position (lockstep; a dense
    rank reports 0 and False): a stepping rank is running ``wave``, a paused
    one waits to start it.
    """

    rank: int
    waiting: int
    running: int
    wave: PeerWave
    stepping: bool
    work: int = -1


ToCoordinator = Union[
    EngineStats, WaveComplete, StartWave, FirstRequest, ScaleEngines, EngineDead, EngineRevived,
    HoldCluster, HoldAck, RegroupCluster, Regrouped, ReleaseCluster, EngineReport,
]

# ---- coordinator -> clients / engines ---------------------------------------------------


class StatsSnapshot(_Msg):
    """Published to clients: per-rank ``[waiting, running]``, the wave, the running flag.

    ``dead`` lists ranks that died (with their causes); ``moved`` maps a restarted
    or added rank to its input addresses and ``nodes`` to its node, so clients
    in any process follow it. ``size`` is how many ranks to route new requests
    to (-1: all of ``counts``); ``len(counts)`` is how many exist. ``work``:
    per rank, the tokens it has left to generate, when its engine says (else empty).
    """

    counts: list[tuple[int, int]]
    wave: int
    running: bool
    seq: int = 0
    dead: dict[int, str] = {}
    moved: dict[int, list[str]] = {}
    size: int = -1
    nodes: dict[int, str] = {}
    work: list[int] = []


class StartDPWave(_Msg, tag=1):
    """Wake every paused engine except ``exclude`` (-1: nobody) into ``wave``."""

    wave: int
    exclude: int = -1


class Shutdown(_Msg, tag=2):
    """Ask engines to leave their loop."""


class Hold(_Msg, tag=3):
    """Pause at the next wave boundary and start no wave alone; answer with ``HoldAck``."""

    epoch: int


class Regroup(_Msg, tag=4):
    """Leave the DP group; ranks below ``dp_size`` join the new one at ``dp_master``, in ``wave``."""

    epoch: int
    dp_size: int
    dp_master: str
    wave: int


class Release(_Msg, tag=5):
    """The hold of ``epoch`` is over."""

    epoch: int


class Resync(_Msg, tag=6):
    """A restarted coordinator asks every engine for an ``EngineReport``."""


ToEngines = Union[StartDPWave, Shutdown, Hold, Regroup, Release, Resync]
BROADCAST_TOPIC: Final = b"all"


def presence_topic(rank: int) -> bytes:
    """The per-rank topic an engine subscribes to so the coordinator can count it."""
    return b"\xffrank" + rank.to_bytes(2, "little")


# ---- handshake -------------------------------------------------------------------------


class Hello(_Msg, tag=1):
    """An engine's first message; ``local``: it runs on the front-end's node."""

    local: bool


class EngineAddresses(_Msg):
    """Where an engine connects for coordination."""

    coordinator_collect: str
    coordinator_broadcast: str


class ParallelConfig(_Msg):
    dp_size: int
    world_size: int
    lockstep: bool
    allreduce_interval: int
    dp_master: str = ""
    stats_interval_s: float = 0.1
    wave: int = 0  # a rank added to a running lockstep cluster starts in the current wave


class Init(_Msg, tag=2):
    addresses: EngineAddresses
    parallel: ParallelConfig


class Ready(_Msg, tag=3):
    capacity: int
    config_hash: str
    input_addresses: list[str]


class Reject(_Msg, tag=4):
    """The front-end refused this engine; ``reason`` says why."""

    reason: str


HandshakeMessage = Union[Hello, Init, Ready, Reject]

# ---- codecs ------------------------------------------------------------------------------

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


request_decoder: Final = Decoder[Request](Request, "request")
request_batch_decoder: Final = Decoder[RequestBatch](RequestBatch, "request batch")
abort_decoder: Final = Decoder[Abort](Abort, "abort")
utility_decoder: Final = Decoder[UtilityCall](UtilityCall, "utility")
output_decoder: Final = Decoder[OutputBatch](OutputBatch, "output")
coordinator_decoder: Final = Decoder[ToCoordinator](ToCoordinator, "coordinator")
snapshot_decoder: Final = Decoder[StatsSnapshot](StatsSnapshot, "stats")
engine_broadcast_decoder: Final = Decoder[ToEngines](ToEngines, "broadcast")
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
