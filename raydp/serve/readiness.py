"""``GET /ready``: readiness that proves generation, for Kubernetes' readiness probes and load balancers.

``/health`` says the server process answers. ``/ready`` says the ranks
behind it generate: each rank the server's client does not know dead gets a
one-token probe request, pinned to it, and must answer within
``probe_timeout_s``. The server is ready (200) while at least ``quorum`` ranks
answered; otherwise 503. Both answers name every rank's state, so a cluster
serving degraded (a rank down for good, or restarting) shows it with a 200.
A probe's result is reused for ``cache_s``, so frequent probes by several
balancers cost the engines one token per rank per interval at most.

The same check serves raydp's own app (a route) and vLLM's front-end (an ASGI
middleware that vLLM's ``--middleware`` flag installs: :class:`ReadyMiddleware`,
wired to the process's client with :func:`install`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from raydp.client.client import Client
from raydp.errors import RaydpError

# An id every vocabulary has; the answer's token does not matter, only that it comes. Two of them: vLLM's
# ExampleConnector (P/D) fails a rank's step on a one-token prompt (raydp.models.vllm.kv_files).
PROBE_PROMPT = [1, 1]
READY_PATH = "/ready"


class Readiness:
    """Probes the client's ranks and caches the verdict (one event loop uses it)."""

    def __init__(self, client: Client, quorum: int = 1, probe_timeout_s: float = 5.0, cache_s: float = 1.0) -> None:
        self.client, self.quorum = client, quorum
        self.probe_timeout_s, self.cache_s = probe_timeout_s, cache_s
        self._last: tuple[float, int, dict[str, Any]] | None = None
        self._lock = asyncio.Lock()

    async def verdict(self) -> tuple[int, dict[str, Any]]:
        """``(status, body)``: 200 with ``"ready"`` or ``"degraded"``, or 503 with ``"not_ready"``."""
        async with self._lock:
            last = self._last
            if last is not None and time.monotonic() - last[0] < self.cache_s:
                return last[1], last[2]
            status, body = await self._probe()
            self._last = (time.monotonic(), status, body)
            return status, body

    async def _probe(self) -> tuple[int, dict[str, Any]]:
        snapshot = self.client.snapshot()
        dead = snapshot.dead if snapshot is not None else {}
        ranks = range(self.client.dp_size)
        states = await asyncio.gather(*(self._probe_rank(r, dead.get(r)) for r in ranks))
        answered = sum(state == "generating" for state in states)
        needed = min(self.quorum, len(ranks))
        status = "not_ready" if answered < needed else ("ready" if answered == len(ranks) else "degraded")
        body = {
            "status": status,
            "ranks": {str(r): state for r, state in zip(ranks, states, strict=True)},
            "generating": answered,
            "quorum": needed,
        }
        return (200 if status != "not_ready" else 503), body

    async def _probe_rank(self, rank: int, dead: str | None) -> str:
        if dead is not None:
            return f"dead ({dead})"
        try:
            handle = self.client.submit(PROBE_PROMPT, max_tokens=1, rank=rank)
        except RaydpError as exc:
            return f"failed: {exc}"
        try:
            await asyncio.to_thread(handle.result, self.probe_timeout_s)
        except TimeoutError:
            self.client.abort(handle.request_id)
            return f"no token within {self.probe_timeout_s:g}s"
        except RaydpError as exc:
            return f"failed: {exc}"
        return "generating"


_INSTALLED: list[Readiness] = []
_ON_SERVING: list[Callable[[], None]] = []


def install(readiness: Readiness, on_serving: Callable[[], None] | None = None) -> None:
    """The check :class:`ReadyMiddleware` answers with, in this process (vLLM builds the middleware itself),
    and what it calls once the app's startup is complete (the server accepts right after)."""
    _INSTALLED[:] = [readiness]
    _ON_SERVING[:] = [on_serving] if on_serving is not None else []


class ReadyMiddleware:
    """ASGI middleware that answers ``GET /ready`` before the app sees it (for vLLM's ``--middleware``).

    It also tells its process's launcher when the app has started: vLLM's
    ``build_and_serve`` returns only when its server stops, so the lifespan's
    ``startup.complete`` is the one moment that is seen from outside.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan" and _ON_SERVING:
            await self.app(scope, receive, _telling_on_startup(send, _ON_SERVING[0]))
            return
        if scope["type"] != "http" or scope["path"] != READY_PATH or not _INSTALLED:
            await self.app(scope, receive, send)
            return
        status, body = await _INSTALLED[0].verdict()
        payload = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def _telling_on_startup(send: Any, on_serving: Callable[[], None]) -> Any:
    async def sending(message: dict[str, Any]) -> None:
        await send(message)
        if message["type"] == "lifespan.startup.complete":
            on_serving()

    return sending
