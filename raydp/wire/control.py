"""The coordinator's messages: what engines, clients and the launcher send it, and what it sends back.

Framing per socket:

* coordinator collect (engines and clients PUSH -> PULL): one :data:`ToCoordinator`;
* coordinator publish (PUB -> client SUB): one :class:`StatsSnapshot`;
* coordinator broadcast (XPUB -> engine SUB): ``[topic, body]`` with a
  :data:`ToEngines` body, on :data:`BROADCAST_TOPIC` (or a rank's
  :func:`presence_topic`, which only counts its subscriber).
"""

from __future__ import annotations

from typing import Final, Union

from raydp.wire.adapters import AdapterState
from raydp.wire.blocks import CacheEvents
from raydp.wire.codec import Decoder, PeerWave, RankCount, WireMessage

# ---- engines and clients -> coordinator ---------------------------------------------


class EngineStats(WireMessage, tag=1):
    """An engine's load, sent when it changed; ``work``: tokens it has left to generate (-1: unknown)."""

    rank: int
    waiting: int
    running: int
    work: int = -1


class WaveComplete(WireMessage, tag=2):
    """Rank 0: every rank paused at the end of ``wave``."""

    rank: int
    wave: PeerWave


class StartWave(WireMessage, tag=3):
    """An engine got a request for a finished wave while paused and started ``wave``."""

    rank: int
    wave: PeerWave


class FirstRequest(WireMessage, tag=4):
    """A client sent the first request of a paused cluster to ``rank`` at ``wave``."""

    rank: int
    wave: PeerWave


class ScaleEngines(WireMessage, tag=5):
    """The launcher changes the rank count (``cluster.scale``).

    The coordinator tracks ``engine_count`` ranks; clients route new requests
    to the first ``size`` of them (-1: all). A scale-up first grows
    ``engine_count`` (the new ranks may report), then ``size`` once they have
    joined; a scale-down first shrinks ``size`` (the highest ranks drain),
    then ``engine_count`` once they are gone. ``prefill``: in a P/D cluster,
    the prefill pool's ranks from now on (``0..prefill-1``; -1: unchanged);
    moving it switches ranks between pools (see :mod:`raydp.orchestration.pools`).
    """

    engine_count: RankCount
    size: RankCount = -1
    prefill: int = -1


class EngineDead(WireMessage, tag=6):
    """The launcher saw ``rank`` die; the coordinator tells every client."""

    rank: int
    cause: str = ""


class EngineRevived(WireMessage, tag=7):
    """``rank`` listens at new addresses on ``node_id`` (a restart, or a rank added by a scale-up)."""

    rank: int
    input_addresses: list[str]
    node_id: str = ""


class HoldCluster(WireMessage, tag=8):
    """Launcher: bring lockstep ranks ``0..gang-1`` to a wave boundary and keep them there.

    ``epoch`` names the change; ``gang`` is the size of the DP group now.
    """

    epoch: int
    gang: int


class HoldAck(WireMessage, tag=9):
    """A held rank's position: its wave and whether it is stepping in it."""

    rank: int
    epoch: int
    wave: PeerWave
    running: bool


class RegroupCluster(WireMessage, tag=10):
    """Launcher, once the gang is held: re-form the DP group with ``dp_size`` ranks at ``dp_master``."""

    epoch: int
    dp_size: int
    dp_master: str


class Regrouped(WireMessage, tag=11):
    """A rank joined the new DP group of ``epoch`` (or, above its size, left the old one)."""

    rank: int
    epoch: int


class ReleaseCluster(WireMessage, tag=12):
    """Launcher: the change is done; ranks may start waves again."""

    epoch: int


class EngineReport(WireMessage, tag=13):
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


class CacheReport(WireMessage, tag=14):
    """An engine's prefix-cache events (engines whose core has ``cache_events()``).

    ``incarnation`` names the engine process (random, fixed for its life), so
    a dead engine's late reports are told from its replacement's; ``seq``
    numbers its reports from 1, so a lost one shows as a gap (then the
    coordinator asks that engine for its whole cache, :class:`SendCache`).
    """

    rank: int
    incarnation: int
    seq: int
    events: CacheEvents


class CacheWanted(WireMessage, tag=15):
    """A client missed a change of ``rank``'s cache picture: publish the whole of it next."""

    rank: int


class AdapterReport(WireMessage, tag=16):
    """The adapters an engine holds (engines whose core has ``adapters()``), sent when they change."""

    rank: int
    state: AdapterState


ToCoordinator = Union[
    EngineStats,
    WaveComplete,
    StartWave,
    FirstRequest,
    ScaleEngines,
    EngineDead,
    EngineRevived,
    HoldCluster,
    HoldAck,
    RegroupCluster,
    Regrouped,
    ReleaseCluster,
    EngineReport,
    CacheReport,
    CacheWanted,
    AdapterReport,
]

# ---- coordinator -> clients / engines ---------------------------------------------------


class CacheChange(WireMessage):
    """One change of a rank's cache picture, published to clients.

    The coordinator numbers each rank's changes: this one turns version
    ``base`` into ``version``; ``base == -1`` means ``stored`` is the whole
    picture. A client whose version is not ``base`` missed one, and asks for
    the whole picture (:class:`CacheWanted`).
    """

    rank: int
    version: int
    base: int
    block_size: int
    stored: list[int] = []
    removed: list[int] = []


class StatsSnapshot(WireMessage):
    """Published to clients: per-rank ``[waiting, running]``, the wave, the running flag.

    ``dead`` lists ranks that died (with their causes); ``moved`` maps a restarted
    or added rank to its input addresses and ``nodes`` to its node, so clients
    in any process follow it. ``size`` is how many ranks to route new requests
    to (-1: all of ``counts``); ``len(counts)`` is how many exist. ``work``:
    per rank, the tokens it has left to generate, when its engine says (else empty).
    ``cache``: changes of the ranks' prefix-cache pictures since the last
    snapshot; ``hits``: per rank, ``(looked up, found)`` prompt tokens of its
    prefix cache; ``cache_versions``: the version of each rank's picture, so
    a client that missed the last change knows, and ``cache_epoch`` names this
    coordinator's numbering (a successor's starts again), so a client never
    applies one coordinator's change to another's picture (all empty or 0
    while no engine reports a cache). ``adapters``: per rank, the LoRA
    adapters it holds (empty while no engine reports any; a few names per
    rank, so each snapshot carries them whole), without their ``known``
    adapters: those are merged over the ranks into ``adapter_paths`` (name ->
    path), once per snapshot rather than once per rank. ``prefill_ranks``: in
    a P/D cluster whose pools were resized, ranks ``0..prefill_ranks-1``
    prefill (-1: no change since launch; keep the launch endpoints' boundary).
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
    cache: list[CacheChange] = []
    hits: list[tuple[int, int]] = []
    cache_versions: list[int] = []
    cache_epoch: int = 0
    adapters: list[AdapterState] = []
    adapter_paths: dict[str, str] = {}
    prefill_ranks: int = -1


class StartDPWave(WireMessage, tag=1):
    """Wake every paused engine except ``exclude`` (-1: nobody) into ``wave``."""

    wave: int
    exclude: int = -1


class Shutdown(WireMessage, tag=2):
    """Ask engines to leave their loop."""


class Hold(WireMessage, tag=3):
    """Pause at the next wave boundary and start no wave alone; answer with ``HoldAck``."""

    epoch: int


class Regroup(WireMessage, tag=4):
    """Leave the DP group; ranks below ``dp_size`` join the new one at ``dp_master``, in ``wave``."""

    epoch: int
    dp_size: int
    dp_master: str
    wave: int


class Release(WireMessage, tag=5):
    """The hold of ``epoch`` is over."""

    epoch: int


class Resync(WireMessage, tag=6):
    """A restarted coordinator asks every engine for an ``EngineReport``."""


class SendCache(WireMessage, tag=7):
    """Sent on one rank's presence topic: report your whole prefix cache (a report of yours was lost)."""


ToEngines = Union[StartDPWave, Shutdown, Hold, Regroup, Release, Resync, SendCache]
BROADCAST_TOPIC: Final = b"all"


def presence_topic(rank: int) -> bytes:
    """The per-rank topic an engine subscribes to so the coordinator can count it."""
    return b"\xffrank" + rank.to_bytes(2, "little")


coordinator_decoder: Final = Decoder[ToCoordinator](ToCoordinator, "coordinator")
snapshot_decoder: Final = Decoder[StatsSnapshot](StatsSnapshot, "stats")
engine_broadcast_decoder: Final = Decoder[ToEngines](ToEngines, "broadcast")
