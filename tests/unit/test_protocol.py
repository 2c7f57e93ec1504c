"""Wire messages: round trips through the module's own decoders, and bad input."""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raydp.errors import ProtocolError
from raydp.wire import blocks, codec
from raydp.wire import control as c
from raydp.wire import protocol as p
from raydp.wire.adapters import AdapterState
from raydp.wire.blocks import CacheEvents
from raydp.wire.sampling import Sampling

MESSAGE_MODULES = (p, c, blocks)  # every module that defines wire messages and their decoders

Decode = Any  # one of the module's Decoder instances (or a wrapper of decode_input)

# Every message with the decoder that reads it off its socket: once with only
# the required fields (defaults are omitted on the wire) and once with all set.
CASES: list[tuple[msgspec.Struct, Decode]] = [
    (p.Request(request_id="r1", prompt_token_ids=[]), p.request_decoder),
    (
        p.Request(
            request_id="r2",
            prompt_token_ids=[1, 2, 3],
            max_tokens=7,
            wave=4,
            arrival_time=12.5,
            sampling=Sampling(
                temperature=0.7, top_p=0.9, top_k=40, seed=3, stop=["\n"], stop_token_ids=[2], ignore_eos=True
            ),
            adapter="sql-lora",
        ),
        p.request_decoder,
    ),
    (p.RequestBatch(requests=[]), p.request_batch_decoder),
    (
        p.RequestBatch(
            requests=[
                p.Request(request_id="b1", prompt_token_ids=[1]),
                p.Request(request_id="b2", prompt_token_ids=[2, 3], max_tokens=4, wave=1, seq=8),
                p.Request(request_id="b3", prompt_token_ids=[4], native=b"\x93\xa2b3\x91\x04"),
                p.Request(request_id="b4", prompt_token_ids=[5, 6], max_tokens=1, prefill_only=True),
                p.Request(request_id="b5", prompt_token_ids=[5, 6, 9], max_tokens=3, prefilled=2),
            ]
        ),
        p.request_batch_decoder,
    ),
    (p.Abort(request_ids=[]), p.abort_decoder),
    (p.Abort(request_ids=["a", "b"]), p.abort_decoder),
    (p.UtilityCall(call_id=1, method="reset"), p.utility_decoder),
    (p.UtilityCall(call_id=2, method="set", args=[1, "x", [2.5, None], {"k": True}]), p.utility_decoder),
    (p.OutputBatch(rank=0), p.output_decoder),
    (
        p.OutputBatch(
            rank=3,
            outputs=[
                p.Output(request_id="r1", token_ids=[5], seq=8),
                p.Output(request_id="r2", token_ids=[], finished=True, finish_reason="length"),
                p.Output(request_id="r3", token_ids=[], finished=True, finish_reason="error", error="boom"),
                p.Output(request_id="r4", token_ids=[9], native=b"\x92\xa2r4\x91\x09"),
            ],
            utility=p.UtilityResult(call_id=2, result={"ok": [1, 2]}),
        ),
        p.output_decoder,
    ),
    (p.OutputBatch(rank=1, utility=p.UtilityResult(call_id=9, error="no such method")), p.output_decoder),
    (c.EngineStats(rank=1, waiting=2, running=3), c.coordinator_decoder),
    (c.EngineStats(rank=1, waiting=2, running=3, work=640), c.coordinator_decoder),
    (c.WaveComplete(rank=0, wave=5), c.coordinator_decoder),
    (c.StartWave(rank=2, wave=6), c.coordinator_decoder),
    (c.FirstRequest(rank=3, wave=7), c.coordinator_decoder),
    (c.ScaleEngines(engine_count=8), c.coordinator_decoder),
    (c.StatsSnapshot(counts=[], wave=0, running=False), c.snapshot_decoder),
    (c.StatsSnapshot(counts=[(1, 2), (0, 5)], wave=3, running=True, seq=11), c.snapshot_decoder),
    (c.StatsSnapshot(counts=[(1, 2), (0, 5)], wave=3, running=True, seq=12, work=[70, -1]), c.snapshot_decoder),
    (c.StartDPWave(wave=4), c.engine_broadcast_decoder),
    (c.StartDPWave(wave=4, exclude=2), c.engine_broadcast_decoder),
    (c.Shutdown(), c.engine_broadcast_decoder),
    (p.Hello(local=True), p.handshake_decoder),
    (p.Hello(local=False), p.handshake_decoder),
    (
        p.Init(
            addresses=p.EngineAddresses(coordinator_collect="ipc:///tmp/c", coordinator_broadcast="ipc:///tmp/b"),
            parallel=p.ParallelConfig(dp_size=4, world_size=2, lockstep=True, allreduce_interval=32),
        ),
        p.handshake_decoder,
    ),
    (
        p.Init(
            addresses=p.EngineAddresses(
                coordinator_collect="tcp://10.0.0.1:5000", coordinator_broadcast="tcp://10.0.0.1:5001"
            ),
            parallel=p.ParallelConfig(
                dp_size=2,
                world_size=8,
                lockstep=False,
                allreduce_interval=1,
                dp_master="10.0.0.1:29500",
                stats_interval_s=0.25,
            ),
        ),
        p.handshake_decoder,
    ),
    (
        p.Ready(capacity=1024, config_hash="abcd", input_addresses=["tcp://10.0.0.2:6000"]),
        p.handshake_decoder,
    ),
    (p.Reject(reason="duplicate rank 1"), p.handshake_decoder),
    (c.EngineDead(rank=2, cause="node died"), c.coordinator_decoder),
    (c.EngineRevived(rank=2, input_addresses=["ipc:///tmp/x", "tcp://10.0.0.3:7000"]), c.coordinator_decoder),
    (
        c.StatsSnapshot(
            counts=[(0, 1), (2, 3)],
            wave=4,
            running=False,
            seq=9,
            dead={1: "killed"},
            moved={0: ["tcp://10.0.0.4:7001"]},
        ),
        c.snapshot_decoder,
    ),
    # ---- LoRA adapters
    (c.AdapterReport(rank=1, state=AdapterState()), c.coordinator_decoder),
    (
        c.AdapterReport(rank=0, state=AdapterState(["a", "b"], 2, 5, 3, 40, 31, {"a": "/adapters/a"}, ["c"])),
        c.coordinator_decoder,
    ),
    (
        c.StatsSnapshot(
            counts=[(0, 1)],
            wave=0,
            running=True,
            adapters=[AdapterState(["a"], 2, 1, 0, 4, 3)],
            adapter_paths={"a": "/adapters/a"},
        ),
        c.snapshot_decoder,
    ),
    # ---- elastic scaling
    (c.ScaleEngines(engine_count=4, size=2), c.coordinator_decoder),
    (c.ScaleEngines(engine_count=5, size=5, prefill=3), c.coordinator_decoder),
    (c.EngineRevived(rank=3, input_addresses=["tcp://10.0.0.5:7002"], node_id="node-b"), c.coordinator_decoder),
    (
        c.StatsSnapshot(
            counts=[(0, 0), (1, 0), (0, 2)],
            wave=2,
            running=True,
            seq=3,
            size=2,
            moved={2: ["tcp://10.0.0.5:7002"]},
            nodes={2: "node-b"},
        ),
        c.snapshot_decoder,
    ),
    (c.StatsSnapshot(counts=[(0, 0), (1, 0), (0, 2)], wave=2, running=True, prefill_ranks=2), c.snapshot_decoder),
    (c.HoldCluster(epoch=1, gang=4), c.coordinator_decoder),
    (c.HoldAck(rank=2, epoch=1, wave=7, running=True), c.coordinator_decoder),
    (c.HoldAck(rank=0, epoch=1, wave=8, running=False), c.coordinator_decoder),
    (c.RegroupCluster(epoch=1, dp_size=2, dp_master="10.0.0.1:29501"), c.coordinator_decoder),
    (c.Regrouped(rank=3, epoch=1), c.coordinator_decoder),
    (c.ReleaseCluster(epoch=1), c.coordinator_decoder),
    (c.Hold(epoch=2), c.engine_broadcast_decoder),
    (c.Regroup(epoch=2, dp_size=6, dp_master="10.0.0.1:29502", wave=9), c.engine_broadcast_decoder),
    (c.Release(epoch=2), c.engine_broadcast_decoder),
    (c.Resync(), c.engine_broadcast_decoder),
    (c.EngineReport(rank=1, waiting=2, running=3, wave=4, stepping=True), c.coordinator_decoder),
    (c.EngineReport(rank=1, waiting=2, running=3, wave=4, stepping=True, work=12), c.coordinator_decoder),
    (c.CacheReport(rank=1, incarnation=5, seq=1, events=CacheEvents(block_size=16)), c.coordinator_decoder),
    (
        c.CacheReport(
            rank=0,
            incarnation=2**62,
            seq=9,
            events=CacheEvents(16, [2**64 - 1, 5], [7], full=True, queried=96, hits=64),
        ),
        c.coordinator_decoder,
    ),
    (c.SendCache(), c.engine_broadcast_decoder),
    (c.CacheWanted(rank=3), c.coordinator_decoder),
    (
        c.StatsSnapshot(
            counts=[(0, 1)],
            wave=0,
            running=False,
            cache=[c.CacheChange(rank=0, version=2, base=1, block_size=16, stored=[3], removed=[4])],
            hits=[(96, 64)],
            cache_versions=[2],
            cache_epoch=12345,
        ),
        c.snapshot_decoder,
    ),
    (
        p.Init(
            addresses=p.EngineAddresses(
                coordinator_collect="tcp://10.0.0.1:5000", coordinator_broadcast="tcp://10.0.0.1:5001"
            ),
            parallel=p.ParallelConfig(
                dp_size=3, world_size=1, lockstep=True, allreduce_interval=8, dp_master="10.0.0.1:29502", wave=9
            ),
        ),
        p.handshake_decoder,
    ),
]

DECODERS = {
    name: obj for module in MESSAGE_MODULES for name, obj in vars(module).items() if isinstance(obj, codec.Decoder)
}


def _case_id(case: tuple[msgspec.Struct, Decode]) -> str:
    return type(case[0]).__name__


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_round_trip(case: tuple[msgspec.Struct, Decode]) -> None:
    msg, decoder = case
    data = codec.encode(msg)
    assert isinstance(data, bytes)
    decoded = decoder(data)
    assert type(decoded) is type(msg)
    assert decoded == msg


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_round_trip_from_memoryview(case: tuple[msgspec.Struct, Decode]) -> None:
    msg, decoder = case
    assert decoder(memoryview(codec.encode(msg))) == msg  # zero-copy frames from pyzmq


def test_every_message_type_has_a_round_trip_case() -> None:
    defined = {
        obj
        for module in MESSAGE_MODULES
        for obj in vars(module).values()
        if inspect.isclass(obj)
        and issubclass(obj, msgspec.Struct)
        and obj.__module__ == module.__name__
        and not obj.__name__.startswith("_")
    }
    covered: set[type] = set()

    def walk(value: object) -> None:
        if isinstance(value, msgspec.Struct):
            covered.add(type(value))
            for name in value.__struct_fields__:
                walk(getattr(value, name))
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)

    for msg, _ in CASES:
        walk(msg)
    missing = sorted(t.__name__ for t in defined - covered)
    assert not missing, f"message types with no round-trip test: {missing}"


def test_every_optional_field_travels_set_in_some_case() -> None:
    """Defaults are omitted on the wire, so a field only ever sent at its default is untested."""
    unset: set[str] = set()
    seen: set[str] = set()

    def walk(value: object) -> None:
        if isinstance(value, msgspec.Struct):
            info = msgspec.inspect.type_info(type(value))
            assert isinstance(info, msgspec.inspect.StructType)
            for f in info.fields:
                current = getattr(value, f.name)
                if f.required:
                    pass
                elif current != (f.default if f.default is not msgspec.NODEFAULT else f.default_factory()):
                    seen.add(f"{type(value).__name__}.{f.name}")
                else:
                    unset.add(f"{type(value).__name__}.{f.name}")
                walk(current)
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)

    for msg, _ in CASES:
        walk(msg)
    missing = sorted(unset - seen)
    assert not missing, f"optional fields never set to a non-default value in a round-trip case: {missing}"


def test_every_decoder_is_exercised() -> None:
    used = {id(decoder) for _, decoder in CASES}
    unused = sorted(name for name, decoder in DECODERS.items() if id(decoder) not in used)
    assert not unused, f"decoders with no round-trip test: {unused}"


def test_union_decoders_return_the_encoded_member() -> None:
    for msg in (
        c.EngineStats(rank=0, waiting=0, running=0),
        c.WaveComplete(rank=0, wave=0),
        c.StartWave(rank=0, wave=0),
        c.FirstRequest(rank=0, wave=0),
        c.ScaleEngines(engine_count=0),
        c.ScaleEngines(engine_count=0, size=0),
        c.HoldCluster(epoch=0, gang=0),
        c.HoldAck(rank=0, epoch=0, wave=0, running=False),
        c.RegroupCluster(epoch=0, dp_size=0, dp_master=""),
        c.Regrouped(rank=0, epoch=0),
        c.ReleaseCluster(epoch=0),
        c.EngineReport(rank=0, waiting=0, running=0, wave=0, stepping=False),
    ):
        assert type(c.coordinator_decoder(codec.encode(msg))) is type(msg)
    for msg in (
        c.StartDPWave(wave=0),
        c.Shutdown(),
        c.Hold(epoch=0),
        c.Regroup(epoch=0, dp_size=0, dp_master="", wave=0),
        c.Release(epoch=0),
        c.Resync(),
    ):
        assert type(c.engine_broadcast_decoder(codec.encode(msg))) is type(msg)
    ready = p.Ready(capacity=0, config_hash="", input_addresses=[])
    for msg in (p.Hello(local=True), p.Reject(reason=""), ready):
        assert type(p.handshake_decoder(codec.encode(msg))) is type(msg)


@given(
    request_id=st.text(max_size=20),
    tokens=st.lists(st.integers(0, 2**31 - 1), max_size=20),
    max_tokens=st.integers(-(2**63), 2**63 - 1),
    wave=st.integers(0, 2**63 - 1),
    arrival=st.floats(allow_nan=False),
)
@settings(max_examples=100, deadline=None)
def test_request_round_trip_property(
    request_id: str, tokens: list[int], max_tokens: int, wave: int, arrival: float
) -> None:
    req = p.Request(
        request_id=request_id, prompt_token_ids=tokens, max_tokens=max_tokens, wave=wave, arrival_time=arrival
    )
    assert p.decode_input(p.RequestType.ADD.value, codec.encode(req)) == req


# ---- engine input by tag ----------------------------------------------------------------


def test_request_tags_are_single_distinct_bytes() -> None:
    tags = [t.value for t in p.RequestType]
    assert all(isinstance(t, bytes) and len(t) == 1 for t in tags)
    assert len(set(tags)) == len(tags)
    assert p.RequestType.ADD.value == b"\x00"
    assert p.RequestType.ABORT.value == b"\x01"
    assert p.RequestType.UTILITY.value == b"\x02"


@pytest.mark.parametrize(
    ("tag", "msg"),
    [
        (p.RequestType.ADD, p.Request(request_id="r", prompt_token_ids=[1], wave=3)),
        (p.RequestType.ADD_MANY, p.RequestBatch(requests=[p.Request(request_id="r", prompt_token_ids=[1])])),
        (p.RequestType.ABORT, p.Abort(request_ids=["r"])),
        (p.RequestType.UTILITY, p.UtilityCall(call_id=5, method="stats", args=[1])),
    ],
)
def test_decode_input_by_tag(tag: p.RequestType, msg: msgspec.Struct) -> None:
    decoded = p.decode_input(tag.value, codec.encode(msg))
    assert type(decoded) is type(msg)
    assert decoded == msg


@pytest.mark.parametrize("tag", [b"\x04", b"\xff", b"", b"\x00\x00", b"A"])
def test_decode_input_unknown_tag(tag: bytes) -> None:
    body = codec.encode(p.Request(request_id="r", prompt_token_ids=[]))
    with pytest.raises(ProtocolError, match="unknown request type tag") as info:
        p.decode_input(tag, body)
    assert repr(tag) in str(info.value)


def test_decode_input_tag_body_mismatch() -> None:
    body = codec.encode(p.Abort(request_ids=["r"]))
    with pytest.raises(ProtocolError, match="bad request message"):
        p.decode_input(p.RequestType.ADD.value, body)


# ---- bad bytes --------------------------------------------------------------------------

GARBAGE = [
    b"",
    b"\xc1",  # never used in msgpack
    b"\xff\xff\xff\xff",
    b"not msgpack at all",
    b"\x92\xc1\xc1",
    b"\xdd\xff\xff\xff\xff",  # array header claiming 4 billion items
    b"\x81\xa1a\x01",  # a map where an array is expected
    b"\xc0",  # nil
    b"\x2a",  # a bare int
    codec.encode(p.Request(request_id="r", prompt_token_ids=[1])) + b"\x00",  # trailing bytes
]


@pytest.mark.parametrize("name", sorted(DECODERS))
@pytest.mark.parametrize("data", GARBAGE, ids=range(len(GARBAGE)))
def test_garbage_raises_protocol_error(name: str, data: bytes) -> None:
    decoder = DECODERS[name]
    with pytest.raises(ProtocolError, match=r"^bad [\w ]+ message: "):
        decoder(data)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_every_truncation_raises_protocol_error(case: tuple[msgspec.Struct, Decode]) -> None:
    msg, decoder = case
    data = codec.encode(msg)
    for end in range(len(data)):
        with pytest.raises(ProtocolError):
            decoder(data[:end])


# Pairs where another message happens to have the same positional shape as a
# valid one (untagged array_like structs): Shutdown is [2] == OutputBatch(rank=2),
# Reject("r") is [4, "r"] == UtilityCall(4, "r"), Release(e) is [5, e] ==
# ScaleEngines(engine_count=e), Resync() is [6] == OutputBatch(rank=6), SendCache() is [7] ==
# OutputBatch(rank=7). They travel on different sockets, so they cannot meet in practice.
# Abort([]) is [[]] == RequestBatch([]) on the same socket, but the frame's tag tells them apart.
AMBIGUOUS = {
    ("Shutdown", "output_decoder"),
    ("Reject", "utility_decoder"),
    ("Release", "coordinator_decoder"),
    ("Resync", "output_decoder"),
    ("SendCache", "output_decoder"),
    ("Abort", "request_batch_decoder"),
    ("RequestBatch", "abort_decoder"),
}


@pytest.mark.parametrize("name", sorted(DECODERS))
def test_wrong_message_type_raises_protocol_error(name: str) -> None:
    decoder = DECODERS[name]
    own = {type(msg) for msg, dec in CASES if dec is decoder}
    checked = 0
    for msg, _ in CASES:
        if type(msg) in own or (type(msg).__name__, name) in AMBIGUOUS:
            continue
        with pytest.raises(ProtocolError):
            result = decoder(codec.encode(msg))
            pytest.fail(f"{name} decoded a {type(msg).__name__} as {result!r}")
        checked += 1
    assert checked >= 10


def test_wrong_type_examples_name_the_problem() -> None:
    with pytest.raises(ProtocolError, match="bad stats message"):
        c.snapshot_decoder(codec.encode(p.Request(request_id="r", prompt_token_ids=[])))
    with pytest.raises(ProtocolError, match="bad coordinator message"):
        c.coordinator_decoder(codec.encode(c.StartDPWave(wave=1)))
    with pytest.raises(ProtocolError, match="bad broadcast message"):
        c.engine_broadcast_decoder(codec.encode(c.FirstRequest(rank=0, wave=1)))
    with pytest.raises(ProtocolError, match="bad handshake message"):
        p.handshake_decoder(codec.encode(c.EngineStats(rank=0, waiting=0, running=0)))


def test_field_of_the_wrong_type_raises_protocol_error() -> None:
    body = msgspec.msgpack.encode(["r", "not a list"])
    with pytest.raises(ProtocolError, match="bad request message"):
        p.request_decoder(body)
    with pytest.raises(ProtocolError):
        c.coordinator_decoder(msgspec.msgpack.encode([1, "rank", 0, 0]))


def test_unknown_union_tag_raises_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        c.coordinator_decoder(msgspec.msgpack.encode([99, 0, 0]))
    with pytest.raises(ProtocolError):
        c.engine_broadcast_decoder(msgspec.msgpack.encode([99]))


def test_extra_fields_are_rejected() -> None:
    with pytest.raises(ProtocolError):
        c.coordinator_decoder(msgspec.msgpack.encode([2, 0, 5, "extra"]))


@pytest.mark.parametrize("name", sorted(DECODERS))
@given(data=st.binary(max_size=64))
@settings(max_examples=60, deadline=None)
def test_random_bytes_decode_or_raise_protocol_error(name: str, data: bytes) -> None:
    with contextlib.suppress(ProtocolError):  # anything else fails the test
        DECODERS[name](data)


def test_deeply_nested_input_raises_protocol_error() -> None:
    # A UtilityCall whose args hold 100k nested arrays: hostile but tiny (100 KB).
    data = b"\x93\x01\xa1m" + b"\x91" * 100_000 + b"\xc0"
    with pytest.raises(ProtocolError):
        p.utility_decoder(data)


# ---- handshake identities ---------------------------------------------------------------


@pytest.mark.parametrize("rank", [0, 1, 255, 256, 4095, 65535])
def test_rank_identity_round_trip(rank: int) -> None:
    identity = p.rank_identity(rank)
    assert len(identity) == 2
    assert identity == rank.to_bytes(2, "little")
    assert p.identity_rank(identity) == rank


def test_rank_identity_is_little_endian() -> None:
    assert p.rank_identity(1) == b"\x01\x00"
    assert p.rank_identity(258) == b"\x02\x01"


@pytest.mark.parametrize("identity", [b"", b"\x01", b"\x01\x00\x00", b"\x00" * 5])
def test_identity_of_the_wrong_length(identity: bytes) -> None:
    with pytest.raises(ProtocolError, match=f"2 bytes, got {len(identity)}"):
        p.identity_rank(identity)


def test_presence_topics_are_distinct_from_broadcast() -> None:
    topics = {c.presence_topic(r) for r in range(64)}
    assert len(topics) == 64
    assert all(not t.startswith(c.BROADCAST_TOPIC) for t in topics)


@pytest.mark.parametrize("rank", [-1, 65536])
def test_rank_identity_out_of_range_is_a_protocol_error(rank: int) -> None:
    with pytest.raises(ProtocolError, match=f"rank={rank}"):
        p.rank_identity(rank)
