"""The ExampleConnector's KV folders as a rank counts and removes them (P/D)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from raydp.config import RaydpConfig
from raydp.errors import ConfigError
from raydp.models.vllm.engine import VllmTPEngine
from raydp.models.vllm.kv_files import KvFiles, check_sharding

pytestmark = pytest.mark.timeout(120)
BLOCK = 16


def test_the_folder_is_the_one_vllms_connector_stores_the_prompt_in(tmp_path: Path) -> None:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
        ExampleConnector,
        align_to_block_size,
    )

    files = KvFiles(str(tmp_path), BLOCK)
    connector = SimpleNamespace(_storage_path=str(tmp_path))
    for length in (2, 17, 33, 40):
        prompt = [(5 * k) % 97 for k in range(length)]
        stored = torch.tensor(prompt)[: align_to_block_size(len(prompt), BLOCK)]
        assert files.folder(prompt) == ExampleConnector._generate_foldername_debug(connector, stored, [])


def test_a_folder_goes_when_its_last_user_on_the_rank_ends_unless_it_was_handed_on(tmp_path: Path) -> None:
    files = KvFiles(str(tmp_path), BLOCK)
    prompt = list(range(40))
    (own,) = files.uses(prompt, 0)
    Path(own).mkdir()
    (again,) = files.uses(prompt, 0)  # the same prompt twice on this rank
    files.release(own, remove=True)
    assert Path(own).is_dir(), "the other request still uses it"
    files.release(again, remove=False)  # handed to a decode rank: the files stay for it
    assert Path(own).is_dir()
    decode = files.uses([*prompt, 7], prefilled=len(prompt))
    assert decode[1] == own, "a decode request uses the prefill's folder"
    for folder in decode:
        files.release(folder, remove=True)
    assert list(tmp_path.iterdir()) == []


def test_the_folder_every_short_prompt_shares_is_never_counted_nor_removed(tmp_path: Path) -> None:
    files = KvFiles(str(tmp_path), BLOCK)
    assert files.uses(list(range(BLOCK)), 0) == (), "a block's worth stores nothing of its own"
    assert files.shared_folder() == files.folder([1, 2]) == files.folder(list(range(BLOCK)))
    assert files.uses(list(range(BLOCK + 1)), 0) == (files.folder(list(range(BLOCK + 1))),)


def test_a_one_token_prompt_is_refused_naming_the_field(tmp_path: Path) -> None:
    files = KvFiles(str(tmp_path), BLOCK)
    with pytest.raises(ConfigError, match="prompt_token_ids: a one-token prompt fails vLLM's ExampleConnector"):
        files.check_prompt(1)
    files.check_prompt(2)


def test_only_the_example_connector_leaves_files_to_remove() -> None:
    def config(connector: str | None) -> SimpleNamespace:
        extra = {"get_from_extra_config": lambda key, default: default}
        kv = None if connector is None else SimpleNamespace(kv_connector=connector, **extra)
        return SimpleNamespace(kv_transfer_config=kv, cache_config=SimpleNamespace(block_size=BLOCK))

    assert KvFiles.of(config(None)) is None and KvFiles.of(config("NixlConnector")) is None
    files = KvFiles.of(config("ExampleConnector"))
    assert files is not None and (files.storage_path, files.block_size) == ("/tmp", BLOCK)


def test_a_sharded_rank_with_the_example_connector_is_refused_before_anything_starts() -> None:
    kv = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}
    config = RaydpConfig(
        prefill_dp_size=1,
        decode_dp_size=1,
        prefill_tensor_parallel_size=2,
        engine="raydp.models.vllm:VllmTPEngine",
        engine_kwargs={"model": "/m", "kv_transfer_config": kv},
    )
    with pytest.raises(ConfigError, match="kv_connector='ExampleConnector' with 2 devices per rank"):
        VllmTPEngine.check_engine_kwargs(config)
    check_sharding({"kv_transfer_config": kv}, 1)  # ranks of one device share nothing
    check_sharding({"kv_transfer_config": {**kv, "kv_connector": "NixlConnector"}}, 2)
