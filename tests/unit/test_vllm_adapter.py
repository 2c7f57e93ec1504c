"""The vLLM adapter's pure parts: engine_kwargs checks, vLLM's flags on raydp's CLI, the request mapping."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raydp.cli import vllm_flags
from raydp.errors import ConfigError
from raydp.models.checkpoint import make_model
from raydp.models.vllm import config as vllm_config
from raydp.models.vllm.requests import Tracked, finish_reason, prefill_params, sampling_params
from raydp.wire.sampling import Sampling

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({}, "engine_kwargs.model: required"),
        ({"model": "m", "data_parallel_size": 2}, "engine_kwargs.data_parallel_size=2: raydp sets this (dp_size)"),
        ({"model": "m", "api_server_count": 2}, "engine_kwargs.api_server_count=2: raydp sets this"),
        (
            {"model": "m", "tensor_parallel_size": 4},
            "engine_kwargs.tensor_parallel_size=4: must match raydp's tensor_parallel_size=1",
        ),
    ],
)
def test_fields_raydp_owns_are_refused_naming_them(kwargs: dict[str, object], said: str) -> None:
    with pytest.raises(ConfigError, match=said.replace("(", r"\(").replace(")", r"\)")):
        vllm_config.check_kwargs(kwargs, 1, 1)


def test_an_unknown_vllm_field_is_refused_naming_it_and_known_ones_pass_through(tmp_path: Path) -> None:
    # A local directory: with the hub offline (as a rank sets it, and as an earlier test in this process may
    # have), vLLM resolves any other model name on the hub's local cache.
    model = str(tmp_path)
    with pytest.raises(ConfigError, match=r"engine_kwargs\.max_modle_len: not a vLLM engine argument"):
        vllm_config.engine_args({"model": model, "max_modle_len": 5}, 1, 1)
    args = vllm_config.engine_args({"model": model, "max_model_len": 77, "enforce_eager": True}, 1, 1)
    assert (args.model, args.max_model_len, args.enforce_eager, args.tensor_parallel_size) == (model, 77, True, 1)


def test_vllms_own_flags_become_engine_kwargs_that_differ_from_its_defaults() -> None:
    kwargs = vllm_flags.engine_kwargs("/m", ["--max-model-len", "512", "--enforce-eager", "--dtype", "float32"])
    assert kwargs == {"model": "/m", "max_model_len": 512, "enforce_eager": True, "dtype": "float32"}
    with pytest.raises(ConfigError, match="--model: required"):
        vllm_flags.engine_kwargs(None, [])
    with pytest.raises(ConfigError, match="vLLM's parser refused them"):
        vllm_flags.engine_kwargs("/m", ["--max-model-len", "lots"])


@pytest.mark.parametrize("form", ["spaced", "joined"])
def test_a_config_object_flag_passes_as_the_users_own_json(form: str) -> None:
    kv = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}
    flag = ["--kv-transfer-config", json.dumps(kv)] if form == "spaced" else [f"--kv-transfer-config={json.dumps(kv)}"]
    assert vllm_flags.engine_kwargs("/m", flag) == {"model": "/m", "kv_transfer_config": kv}


def test_a_p_d_prefill_makes_one_token_and_keeps_the_first_tokens_eos_rule() -> None:
    params = prefill_params(sampling_params(None, 9))
    assert (params.max_tokens, params.min_tokens) == (1, 0)
    held = sampling_params(None, 9)
    held.min_tokens = 4
    assert prefill_params(held).min_tokens == 1 and held.min_tokens == 4, "a copy; the decode rank gets the rest"


def test_sampling_maps_to_vllms_fields_and_none_is_greedy() -> None:
    greedy = sampling_params(None, 9)
    assert (greedy.temperature, greedy.max_tokens, greedy.seed) == (0.0, 9, None)
    params = sampling_params(
        Sampling(temperature=0.5, top_p=0.9, top_k=7, seed=3, stop_token_ids=[4], ignore_eos=True), 5
    )
    assert (params.temperature, params.top_p, params.top_k, params.seed, params.ignore_eos) == (0.5, 0.9, 7, 3, True)
    assert params.stop_token_ids == [4] and not params.stop, "stop strings are the rank's, not vLLM's core's"
    assert [finish_reason(r) for r in (None, 0, 1, 2, 3, 4)] == [None, "stop", "length", "abort", "error", "stop"]


def test_a_stop_string_completed_across_tokens_is_seen_and_work_counts_down(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(make_model(tmp_path / "m")), local_files_only=True)
    ids = tokenizer.encode("the quick brown fox", add_special_tokens=False)
    tracked = Tracked(max_tokens=10, stops=["own fo"])
    seen = []
    for token in ids:
        tracked.add([token])
        seen.append(tracked.hit_stop(tokenizer))
    assert seen[-1] and not seen[0], "seen once the text holds it, not before"
    assert tracked.left() == 10 - len(ids)
    assert not Tracked(4, []).hit_stop(tokenizer), "no stop strings: nothing to decode"


def test_vllms_cache_events_become_raydp_block_names_and_evictions_undo_them() -> None:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    from raydp.models.vllm.cache import VllmCacheEvents
    from raydp.wire.blocks import block_digests

    def stored(hashes: list[int], parent: int | None, tokens: list[int], **extra: object) -> BlockStored:
        fields: dict[str, object] = {"lora_id": None, "medium": "GPU", "lora_name": None, **extra}
        return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=4, **fields)

    prompt = list(range(12))
    names = block_digests(prompt, 4)
    cache = VllmCacheEvents(block_size=4)
    cache.publish(KVEventBatch(ts=0.0, events=[stored([11, 12], None, prompt[:8]), stored([13], 12, prompt[8:])]))
    cache.publish(KVEventBatch(ts=0.0, events=[stored([99], None, [7, 7, 7, 7], extra_keys=[("salt",)])]))
    cache.publish(KVEventBatch(ts=0.0, events=[stored([98], 555, [1, 1, 1, 1])]))  # its parent was never seen
    cache.count(12, 8)
    first = cache.events(full=False)
    assert first is not None and first.stored == names  # the names any client computes from the prompt
    assert (first.queried, first.hits, first.block_size) == (12, 8, 4)
    assert cache.events(full=False) is None
    cache.publish(KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[13], medium="GPU")]))
    removed = cache.events(full=False)
    assert removed is not None and removed.removed == [names[2]] and removed.stored == []
    whole = cache.events(full=True)
    assert whole is not None and whole.full and whole.stored == names[:2]
    cache.publish(KVEventBatch(ts=0.0, events=[stored([11], None, prompt[:4])]))  # a second copy of block 0
    cache.publish(KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[11], medium="GPU")]))  # one copy goes
    assert cache.events(full=False) is None  # the other still holds the prefix
    cache.publish(KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
    cleared = cache.events(full=False)
    assert cleared is not None and sorted(cleared.removed) == sorted(names[:2])


def test_kv_events_are_turned_on_unless_the_user_configured_them_and_the_users_publisher_still_gets_them() -> None:
    from vllm.config import KVEventsConfig
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    from raydp.models.vllm.cache import TeePublisher, VllmCacheEvents, events_config

    ours = events_config({"model": "m"})["kv_events_config"]
    assert ours.enable_kv_cache_events and ours.publisher == "null"
    theirs = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq")
    assert events_config({"model": "m", "kv_events_config": theirs})["kv_events_config"] is theirs
    assert "kv_events_config" not in events_config({"model": "m", "enable_prefix_caching": False})

    class Users:
        def __init__(self) -> None:
            self.batches: list[object] = []
            self.closed = False

        def publish(self, batch: object) -> None:
            self.batches.append(batch)

        def shutdown(self) -> None:
            self.closed = True

    users, cache = Users(), VllmCacheEvents(block_size=4)
    tee = TeePublisher(cache, users)
    block = BlockStored(
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=[1, 2, 3, 4],
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    batch = KVEventBatch(ts=0.0, events=[block])
    tee.publish(batch)
    tee.shutdown()
    assert users.batches == [batch] and users.closed
    events = cache.events(full=False)
    assert events is not None and len(events.stored) == 1
