"""``build_app``: the HTTP API over one :class:`~raydp.client.client.Client`, as a Starlette app.

Routes:

* ``POST /v1/completions``: OpenAI completions, plain or streamed (:mod:`.completions`);
* ``POST /v1/chat/completions``: OpenAI chat completions, plain or streamed, over the
  tokenizer's chat template (:mod:`.chat`);
* ``POST /v1/generate``: ``{"prompt_token_ids", "max_tokens", "rank"?}`` -> ``{"token_ids"}``;
* ``GET /v1/models``: the one model served, in OpenAI's list shape;
* ``GET /health``: ``{"status": "ok", "client_index": i, "client_count": n}`` (liveness: the process answers);
* ``GET /ready``: 200 while ``ready_quorum`` ranks generate a one-token probe, else 503 (:mod:`.readiness`);
* ``GET /metrics``: Prometheus metrics of this process (:mod:`.metrics`).

With ``api_keys``, the ``/v1/`` routes (and ``/metrics`` if
``protect_metrics``) need one of them as a bearer token (:mod:`.api_keys`);
``/health`` and ``/ready`` never do. Text is encoded and decoded with the server's
tokenizer (:mod:`raydp.text`).
Every error is JSON in OpenAI's error shape (:mod:`.api_errors`). The app
runs under any ASGI server; :func:`~raydp.serve.server.serve_on_socket` is the
one raydp uses.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from raydp.client.aio import AsyncClient
from raydp.client.client import Client
from raydp.serve.api_errors import ApiError, api_error_handler, http_exception_handler, internal_error_handler
from raydp.serve.api_keys import ApiKeys
from raydp.serve.bodies import Limits
from raydp.serve.chat import ChatRoute
from raydp.serve.completions import GenerationRoutes
from raydp.serve.draining import InFlight
from raydp.serve.generation import ClientGoneError
from raydp.serve.metrics import CLIENT_GONE, ApiMetrics, RequestMetrics
from raydp.serve.readiness import READY_PATH, Readiness
from raydp.serve.responses import JSON
from raydp.serve.settings import MAX_TOKENS_LIMIT, ServerSettings
from raydp.text.tokenizer import load_tokenizer


def build_app(
    client: Client,
    *,
    model: str,
    max_body_bytes: int = 1 << 20,
    request_timeout_s: float = 300.0,
    metrics: ApiMetrics | None = None,
    max_tokens_limit: int = MAX_TOKENS_LIMIT,
    vocab_size: int | None = None,
    in_flight: InFlight | None = None,
    tokenizer: str | None = None,
    api_keys: Sequence[str] = (),
    protect_metrics: bool = False,
    ready_quorum: int = 1,
) -> Starlette:
    """The API app: ``model`` is the id it serves; ``tokenizer`` a local directory with the
    Hugging Face tokenizer for text and chat (default: the byte tokenizer); token ids must be below
    ``vocab_size`` (default: the tokenizer's vocabulary if one is given, else any id < 2**31);
    ``metrics`` defaults to a fresh :class:`ApiMetrics` of ``client``; ``in_flight`` tracks its
    running requests, for a server that stops (:mod:`.draining`); ``api_keys`` and
    ``protect_metrics`` and ``ready_quorum`` as in :class:`~raydp.serve.settings.ServerSettings`."""
    ServerSettings(
        model=model,
        max_body_bytes=max_body_bytes,
        request_timeout_s=request_timeout_s,
        max_tokens_limit=max_tokens_limit,
        vocab_size=vocab_size,
        tokenizer=tokenizer,
        api_keys=tuple(api_keys),
        protect_metrics=protect_metrics,
        ready_quorum=ready_quorum,
    )  # ConfigError
    text = load_tokenizer(tokenizer)  # raises ConfigError
    if vocab_size is None and tokenizer is not None:
        vocab_size = text.vocab_size
    metrics = metrics if metrics is not None else ApiMetrics(client)
    limits = Limits(model, max_tokens_limit, lambda: client.dp_size, vocab_size)
    generation = GenerationRoutes(
        AsyncClient(client),
        limits,
        max_body_bytes,
        request_timeout_s,
        metrics,
        in_flight if in_flight is not None else InFlight(),
        text,
    )
    chat = ChatRoute(generation)
    created = int(time.time())

    async def health(request: Request) -> Response:
        return JSON({"status": "ok", "client_index": client.client_index, "client_count": client.client_count})

    readiness = Readiness(client, ready_quorum)

    async def ready(request: Request) -> Response:
        status, body = await readiness.verdict()
        return JSON(body, status_code=status)

    async def models(request: Request) -> Response:
        card = {"id": model, "object": "model", "created": created, "owned_by": "raydp"}
        return JSON({"object": "list", "data": [card]})

    async def scrape(request: Request) -> Response:
        body, content_type = metrics.render(request.headers.get("accept"))
        return Response(body, headers={"Content-Type": content_type})

    routes = [
        Route("/v1/completions", generation.completions, methods=["POST"]),
        Route("/v1/chat/completions", chat.completions, methods=["POST"]),
        Route("/v1/generate", generation.generate, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route(READY_PATH, ready, methods=["GET"]),
        Route("/metrics", scrape, methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with metrics.watching():
            yield

    return Starlette(
        routes=routes,
        middleware=[
            Middleware(RequestMetrics, metrics=metrics, routes=[r.path for r in routes]),
            # Without keys there is nothing to check: no layer on every request's path.
            *([Middleware(ApiKeys, keys=list(api_keys), protect_metrics=protect_metrics)] if api_keys else []),
        ],
        exception_handlers={
            ApiError: api_error_handler,
            HTTPException: http_exception_handler,
            ClientGoneError: _client_gone,
            ClientDisconnect: _client_gone,  # hung up (or cut off by the read deadline) mid-body
            Exception: internal_error_handler,
        },
        lifespan=lifespan,
    )


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_GONE)  # nobody reads it; the metrics count it
