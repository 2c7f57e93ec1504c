"""What vLLM's ``ExampleConnector`` leaves on disk for P/D, and its removal once nothing needs it.

The connector stores a prompt's KV in a folder of the shared storage path,
named by a hash of the prompt's tokens up to the last whole block short of
its end, and never removes it; with ``kv_both`` every rank stores every new
prompt it computes. A prefill rank writes that folder; the decode rank that
continues the request (its prompt plus the first token, see
:mod:`raydp.client.pools`) reads it. raydp removes a request's folders when
it ends on a rank, unless it ends by handing off to a decode rank: the
prefill's folder goes with the decode rank's request, and what any other
request stored (a one-token request, a migrated stream, one run whole) with
that request. The one folder that every prompt no longer than a block
shares is left in place (:meth:`KvFiles.uses`).

Each rank counts its own users of a folder, so one request's end never pulls
the files from under another on the same rank. Ranks do not coordinate: of
two identical prompts in flight on different ranks at once, one may find the
folder gone that the other removed, and compute its prompt itself; should the
removal fall inside the other rank's write or read of that folder, that
rank's step fails, and the rank fails and restarts (its streams migrate).
The ExampleConnector is vLLM's reference connector; a real one
(NixlConnector) moves KV between ranks' memories and leaves no files.

The folder names follow vLLM 0.32's connector (``_generate_foldername_debug``);
the tests check that the files are gone after every request.
"""

from __future__ import annotations

import collections
import logging
import os
import shutil
from typing import Any

from raydp.errors import ConfigError

logger = logging.getLogger("raydp.models.vllm")
CONNECTOR = "ExampleConnector"


def check_sharding(engine_kwargs: dict[str, Any], world_size: int) -> None:
    """vLLM's ExampleConnector names its files by layer and prompt only: the device workers of one rank
    would overwrite each other's shards. ConfigError for a rank of more than one device with it."""
    kv = engine_kwargs.get("kv_transfer_config")
    name = kv.get("kv_connector") if isinstance(kv, dict) else getattr(kv, "kv_connector", None)
    if name == CONNECTOR and world_size > 1:
        raise ConfigError(
            f"kv_transfer_config.kv_connector={CONNECTOR!r} with {world_size} devices per rank: the connector "
            "stores one file per layer and prompt, so a rank's shards would overwrite each other; it needs "
            "ranks of one device (on GPUs, vLLM's NixlConnector handles sharded ranks)"
        )


class KvFiles:
    """The connector folders this rank's requests use, counted per folder."""

    def __init__(self, storage_path: str, block_size: int) -> None:
        self.storage_path, self.block_size = storage_path, block_size
        self._users: collections.Counter[str] = collections.Counter()

    @classmethod
    def of(cls, config: Any) -> KvFiles | None:
        """For a vLLM config whose KV connector is the ExampleConnector; None for any other (or none)."""
        kv = config.kv_transfer_config
        if kv is None or kv.kv_connector != CONNECTOR:
            return None
        path = kv.get_from_extra_config("shared_storage_path", "/tmp")
        return cls(str(path), int(config.cache_config.block_size))

    def folder(self, prompt: list[int]) -> str:
        """Where the connector stores ``prompt``'s KV (its whole blocks short of the last token)."""
        import torch
        from vllm.utils.hashing import safe_hash

        stored = (len(prompt) - 1) // self.block_size * self.block_size
        data = torch.tensor(prompt)[:stored].numpy().tobytes()
        return os.path.join(self.storage_path, safe_hash(data, usedforsecurity=False).hexdigest())

    def uses(self, prompt: list[int], prefilled: int) -> tuple[str, ...]:
        """A new request of this rank: the folders it may store (its prompt's) or load (the prefilled
        part's, on a decode rank), each counted once more; the names to :meth:`release` it by.

        Every prompt no longer than a block stores (empty tensors) in one folder, that of no tokens,
        which every rank writes all the time: removing it would pull it from under another rank's
        write (the connector's ``makedirs`` then fails that rank's step). It is left, and not counted.
        """
        parts = (prompt, *((prompt[:prefilled],) if prefilled else ()))
        folders = tuple(self.folder(part) for part in parts if len(part) - 1 >= self.block_size)
        self._users.update(folders)
        return folders

    def check_prompt(self, prompt_len: int) -> None:
        """Refuse a one-token prompt: the connector looks its KV up under a negative block count, which
        names the shared folder, and (once that exists) fails the rank's step (an index out of range)."""
        if prompt_len == 1:
            raise ConfigError(
                "prompt_token_ids: a one-token prompt fails vLLM's ExampleConnector (its KV look-up of no whole "
                "block); send at least 2 tokens, or run without the ExampleConnector"
            )

    def shared_folder(self) -> str:
        """The one folder of every prompt no longer than a block (left in place; see :meth:`uses`)."""
        return self.folder([0])

    def release(self, folder: str, remove: bool) -> None:
        """The request is done with ``folder``; ``remove``: nobody after it needs the files."""
        self._users[folder] -= 1
        if self._users[folder] > 0:
            return
        del self._users[folder]
        if remove:
            shutil.rmtree(folder, ignore_errors=True)
