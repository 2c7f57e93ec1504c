"""vLLM's own OpenAI server in a raydp API server process, over raydp's ranks.

``raydp serve --engine vllm`` runs this in each of its API server processes
instead of raydp's small server: vLLM's whole front-end (its FastAPI app, its
request models, chat templates, tool and reasoning parsers, structured
outputs, logprobs, ``n``, LoRA routes, ``/tokenize``, its API keys, TLS and
``/metrics``) over ``AsyncLLM``'s input and output processors, whose engine
core client is raydp's (:class:`~raydp.serve.vllm_core.RaydpCoreClient`). So
what ``vllm serve`` answers, raydp answers, with the same flags. Its
``/metrics`` serves raydp's per-rank series (load, deaths, prefix-cache hit
rates, stream migrations) beside vLLM's, and its LoRA unloads reach every
server (:mod:`raydp.serve.vllm_unloads`). With several API servers on one port
the manager gives them one ``PROMETHEUS_MULTIPROC_DIR``, as vLLM's own
launcher does, so that every scrape answers for all of them.

The process serves on the socket the manager bound (N processes share it),
and stops on SIGTERM, SIGINT or ``stop`` (its parent gone) as vLLM's server
does: in-flight requests get ``--shutdown-timeout`` seconds (vLLM's flag).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from raydp.client.client import Client
from raydp.models.vllm import config as vllm_config
from raydp.models.vllm.native import NativeCodec
from raydp.serve.rank_series import PushedRankSeries
from raydp.serve.readiness import Readiness, ReadyMiddleware, install
from raydp.serve.settings import ServerSettings
from raydp.serve.vllm_core import RaydpCoreClient
from raydp.serve.vllm_loras import ClusterLoraResolver
from raydp.serve.vllm_unloads import ClusterUnloads, UnloadMiddleware
from raydp.serve.vllm_unloads import install as install_unloads
from raydp.wire.endpoints import ClusterEndpoints

STOP_POLL_S = 0.2


def serve_args(argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` parsed by ``vllm serve``'s own parser and checked by its own checks."""
    vllm_config.set_process_environment()
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args: argparse.Namespace = make_arg_parser(FlexibleArgumentParser(prog="raydp serve --engine vllm")).parse_args(
        list(argv)
    )
    validate_parsed_serve_args(args)
    return args


def frontend_argv(settings: ServerSettings, sock: socket.socket) -> list[str]:
    """``vllm serve``'s flags for this server: the user's, then where it listens, its TLS files and keys."""
    host, port = sock.getsockname()[:2]
    argv = [*settings.vllm_args, "--host", str(host), "--port", str(port)]
    for flag, value in (
        ("--ssl-certfile", settings.ssl_certfile),
        ("--ssl-keyfile", settings.ssl_keyfile),
        ("--ssl-ca-certs", settings.ssl_ca_certs),
    ):
        if value is not None:
            argv += [flag, value]
    if settings.ssl_ca_certs is not None:
        argv += ["--ssl-cert-reqs", "2"]  # ssl.CERT_REQUIRED: a client certificate is a must, as raydp's server asks
    if settings.api_keys:
        argv += ["--api-key", *(key.get_secret_value() for key in settings.api_keys)]
    # GET /ready, answered before vLLM's routes and its key check (probes carry no key); LoRA unloads made
    # the cluster's.
    middleware = [f"{m.__module__}.{m.__name__}" for m in (ReadyMiddleware, UnloadMiddleware)]
    return [*argv, *(arg for name in middleware for arg in ("--middleware", name))]


def serve_vllm_forever(
    sock: socket.socket,
    endpoints: ClusterEndpoints,
    client_index: int,
    client_count: int,
    node_id: str | None,
    *,
    ranks: list[int] | None = None,
    settings: ServerSettings,
    stop: threading.Event | None = None,
    on_serving: Callable[[], None] | None = None,
) -> None:
    """Run vLLM's server on ``sock`` until a stop signal or ``stop``; it routes only to ``ranks`` if given.

    ``on_serving`` is called once vLLM's app has started (its server accepts next).
    """
    args = serve_args(frontend_argv(settings, sock))
    client = settings.client(endpoints, client_index, client_count, node_id, ranks)
    try:
        asyncio.run(_serve(sock, args, client, (client_index, client_count), stop, settings.ready_quorum, on_serving))
    finally:
        client.close()


async def _serve(
    sock: socket.socket,
    args: argparse.Namespace,
    client: Client,
    index: tuple[int, int],
    stop: threading.Event | None,
    ready_quorum: int,
    on_serving: Callable[[], None] | None,
) -> None:
    from vllm.entrypoints.launchers.api_server.entry import build_and_serve
    from vllm.lora.resolver import LoRAResolverRegistry

    # Before vLLM's front-end is built: it takes the resolvers registered by then.
    unloads = ClusterUnloads(client)
    resolver = ClusterLoraResolver(lambda: unloads.offered(client.adapter_paths()))
    LoRAResolverRegistry.register_resolver("raydp-cluster", resolver)
    engine = _async_llm(args, lambda: RaydpCoreClient(client, NativeCodec(), unloads), index)
    install(Readiness(client, ready_quorum), on_serving)
    install_unloads(unloads)
    # raydp's per-rank series beside vLLM's own on vLLM's /metrics (multiprocess mode too: see rank_series).
    series = PushedRankSeries(client)
    tasks = [asyncio.ensure_future(series.run())]
    if stop is not None:
        tasks.append(asyncio.ensure_future(_signal_on(stop)))
    try:
        shutdown = await build_and_serve(engine, f"http://{args.host}:{args.port}", sock, args)
        await shutdown
    finally:
        for task in tasks:
            task.cancel()
        engine.shutdown()


def _async_llm(args: argparse.Namespace, make_core: Callable[[], RaydpCoreClient], index: tuple[int, int]) -> Any:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_args = AsyncEngineArgs.from_cli_args(args)
    config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    with _core_client(make_core):
        return AsyncLLM.from_vllm_config(
            vllm_config=config,
            usage_context=UsageContext.OPENAI_API_SERVER,
            enable_log_requests=engine_args.enable_log_requests,
            disable_log_stats=engine_args.disable_log_stats,
            client_index=index[0],
            client_count=index[1],
        )


@contextlib.contextmanager
def _core_client(make_core: Callable[[], RaydpCoreClient]) -> Iterator[None]:
    """``AsyncLLM`` builds its engine core client with this factory and takes no other, so it is swapped
    while the one ``AsyncLLM`` of this process is built (on this thread, before any request)."""
    from vllm.v1.engine.core_client import EngineCoreClient

    original = EngineCoreClient.__dict__["make_async_mp_client"]
    EngineCoreClient.make_async_mp_client = staticmethod(lambda *_, **__: make_core())
    try:
        yield
    finally:
        EngineCoreClient.make_async_mp_client = original


async def _signal_on(stop: threading.Event) -> None:
    """vLLM's server stops on SIGTERM (its own handler drains it): the parent's stop becomes one.

    Sent again every second until the process ends: a stop during startup (the
    parent died while vLLM's app was being built) lands before vLLM's server has
    installed its handler, and only raydp's own sees it. vLLM ignores repeats.
    """
    while not stop.is_set():
        await asyncio.sleep(STOP_POLL_S)
    while True:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(1.0)
