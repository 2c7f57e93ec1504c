"""LoRA unloads across N API servers running vLLM's front-end over one raydp cluster.

vLLM's ``POST /v1/unload_lora_adapter`` only removes the name from the one
front-end that answers it: the engines keep the adapter, and with several API
servers the others go on serving it (they loaded it at startup, or found it
through the ranks' reports: :class:`~raydp.serve.vllm_loras.ClusterLoraResolver`).
So an unload is made the cluster's:

- :class:`UnloadMiddleware` (installed with vLLM's ``--middleware``) sees the
  front-end answer an unload with 200 and has every live rank forget the
  adapter: its slot is freed, its path is no longer offered, and the rank
  reports it as ``unloaded`` until an ``add_lora`` gives it again
  (:meth:`~raydp.models.vllm.adapters.VllmAdapters.forget`);
- before each request, every server drops from its front-end's table the
  adapters the ranks report unloaded and no rank offers (:meth:`ClusterUnloads.prune`),
  unless this server added one itself within ``GRACE_S`` (the reports that
  would show the new load may not have arrived yet);
- the resolver that finds adapters other servers loaded finds none of those,
  nor, for ``GRACE_S``, one this server unloaded (:meth:`ClusterUnloads.offered`).

Between an unload and the next snapshot (a stats interval), another server
may still answer a request for the adapter; after it, every server answers as
vLLM's own server does for an adapter it does not know.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from raydp.client.client import Client
from raydp.errors import RaydpError

logger = logging.getLogger("raydp.serve")
UNLOAD_PATH = "/v1/unload_lora_adapter"
CALL_TIMEOUT_S = 30.0


class ClusterUnloads:
    """One API server's side of cluster-wide unloads (its event loop uses it)."""

    GRACE_S = 10.0

    def __init__(self, client: Client, clock: Callable[[], float] = time.monotonic) -> None:
        self._client, self._clock = client, clock
        self._added: dict[str, float] = {}  # adapter -> when this server last gave it to the ranks
        self._unloaded: dict[str, float] = {}  # adapter -> when this server unloaded it

    def added(self, name: str) -> None:
        """This server gave ``name`` to the ranks (vLLM's ``add_lora``)."""
        now = self._clock()
        # An add older than GRACE_S counts as none (stale()): forgetting it bounds the table by the adds
        # of the last GRACE_S, however many adapter names come and go.
        self._added = {n: at for n, at in self._added.items() if now - at <= self.GRACE_S}
        self._added[name] = now
        self._unloaded.pop(name, None)

    def offered(self, paths: dict[str, str]) -> dict[str, str]:
        """``paths`` (the adapters the ranks offer) less those unloaded: what a resolver may find. One this
        server unloaded stays hidden until the reports show the unload (they come later), ``GRACE_S`` at most;
        after that, the reports say whether it was given again."""
        now, reported = self._clock(), self._reported_unloaded()
        for name, at in list(self._unloaded.items()):
            if name in reported or now - at > self.GRACE_S:
                del self._unloaded[name]
        hidden = self.stale() | set(self._unloaded)
        return {name: path for name, path in paths.items() if name not in hidden}

    def _reported_unloaded(self) -> set[str]:
        snap = self._client.snapshot()
        return set() if snap is None else {name for state in snap.adapters for name in state.unloaded}

    async def forget(self, name: str) -> None:
        """Every live rank forgets ``name``; a rank that cannot be reached is logged (it will restart empty)."""
        self._unloaded[name] = self._clock()  # first: a request meanwhile must not find it again
        ranks = self._client.live_ranks()
        calls = (
            asyncio.to_thread(self._client.call_utility, rank, "forget_adapter", name, timeout=CALL_TIMEOUT_S)
            for rank in ranks
        )
        for rank, answer in zip(ranks, await asyncio.gather(*calls, return_exceptions=True), strict=True):
            if isinstance(answer, (RaydpError, TimeoutError)):
                logger.warning("rank %d did not forget LoRA adapter %r: %s", rank, name, answer)
            elif isinstance(answer, BaseException):
                raise answer

    def stale(self) -> set[str]:
        """Adapters the ranks report unloaded and none offers, that this server did not add lately."""
        snap = self._client.snapshot()
        if snap is None or not any(state.unloaded for state in snap.adapters):
            return set()
        unloaded = self._reported_unloaded() - set(snap.adapter_paths)
        now = self._clock()
        return {name for name in unloaded if now - self._added.get(name, float("-inf")) > self.GRACE_S}

    def prune(self, lora_requests: dict[str, Any]) -> None:
        """Drop the stale adapters from a front-end's table (``OpenAIServingModels.lora_requests``)."""
        for name in self.stale() & set(lora_requests):
            del lora_requests[name]
            logger.info("LoRA adapter %r was unloaded through another API server: removed here too", name)


_INSTALLED: list[ClusterUnloads] = []


def install(unloads: ClusterUnloads) -> None:
    """What :class:`UnloadMiddleware` works with, in this process (vLLM builds the middleware itself)."""
    _INSTALLED[:] = [unloads]


class UnloadMiddleware:
    """ASGI middleware that makes vLLM's LoRA unloads the cluster's (for vLLM's ``--middleware``)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not _INSTALLED:
            await self.app(scope, receive, send)
            return
        unloads = _INSTALLED[0]
        models = getattr(getattr(scope.get("app"), "state", None), "openai_serving_models", None)
        if models is not None:
            unloads.prune(models.lora_requests)
        if scope["path"] != UNLOAD_PATH or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        # The answer is held back until the ranks forgot the adapter: after a 200, no rank offers it.
        body, answer = bytearray(), []

        async def receive_body() -> Any:
            message = await receive()
            if message["type"] == "http.request":
                body.extend(message.get("body", b""))
            return message

        async def hold(message: Any) -> None:
            answer.append(message)

        await self.app(scope, receive_body, hold)
        if answer and answer[0]["type"] == "http.response.start" and answer[0]["status"] == 200:
            await unloads.forget(str(json.loads(bytes(body))["lora_name"]))
        for message in answer:
            await send(message)
