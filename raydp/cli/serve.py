"""``raydp serve``: launch a cluster and N HTTP API servers, then watch until a death or Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from raydp.cli import vllm_flags
from raydp.cli.options import (
    ENGINES,
    SERVING_PRESETS,
    add_config_flags,
    add_model_flag,
    autoscaled,
    config_from_args,
    pools_note,
    with_engine_flags,
)
from raydp.cli.signals import install_stop_handlers
from raydp.cli.vllm_flags import is_vllm
from raydp.client.balancer import POLICIES
from raydp.config import RaydpConfig
from raydp.errors import ConfigError, EngineDeadError, StartupError
from raydp.orchestration.budget import RestartBudget
from raydp.serve.readiness import PROBE_PROMPT
from raydp.serve.settings import ServeEnvironment, ServerSettings

logger = logging.getLogger("raydp.cli")

# A server restarts a dead rank by default, as Ray Serve restarts a replica and Kubernetes a pod:
# nobody is there to decide. 3 restarts within the 10-minute window (Kubernetes resets a pod's
# backoff after 10 minutes of running well): a rank that fails more often than that fails for a
# reason a restart will not fix (a bad device, a request that crashes its engine each time), and
# each restart reloads the model. Repeats wait 2 s, doubling up to 60 s (the config's defaults:
# Kubernetes starts at 10 s, but a model load already spaces engine restarts by tens of seconds).
SERVE_MAX_RESTARTS = 3
PRESETS = {**SERVING_PRESETS, "max_restarts": SERVE_MAX_RESTARTS}
CONFIG_FLAGS = (
    "name",
    "dp_size",
    "dp_size_local",
    "prefill_dp_size",
    "decode_dp_size",
    "tensor_parallel_size",
    "prefill_tensor_parallel_size",
    "pipeline_parallel_size",
    "engine",
    "lockstep",
    "accelerator",
    "placement_strategy",
    "node_allowlist",
    "max_restarts",
    "restart_window_s",
    "restart_backoff_s",
    "step_timeout_s",
    "silence_timeout_s",
    "startup_timeout_s",
    "transport",
    "auth",
    "detached",
)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="launch DP ranks plus HTTP API servers and serve until Ctrl-C or a death",
        description="Launch a data-parallel cluster and N API server processes sharing one "
        "listening socket, with an OpenAI-compatible HTTP API (POST /v1/completions, "
        "GET /v1/models; POST /v1/generate, GET /health, GET /metrics), optionally behind API keys and "
        "over HTTPS. A dead or hung rank is restarted (--max-restarts per --restart-window-s); one "
        "past its budget stays down and the others serve on, degraded. Exits non-zero naming the "
        "component once no rank lives, or the coordinator or an API server is down for good "
        "(with --fail-stop: at the first death); Ctrl-C shuts "
        f"everything down cleanly. Engines by short name: {', '.join(sorted(ENGINES))}; "
        "or a 'module:Class' path.",
    )
    add_config_flags(p, CONFIG_FLAGS, PRESETS)
    add_model_flag(p)
    p.add_argument(
        "--api-servers",
        type=int,
        default=1,
        help="API server processes (default 1); in hybrid mode, per node that holds ranks",
    )
    p.add_argument(
        "--lb-mode",
        choices=["internal", "hybrid", "external"],
        default="internal",
        help="internal (default): API servers on this node route to every rank; hybrid: API "
        "servers on every node that holds ranks, each routing to its own node's ranks; external: "
        "one endpoint per rank (port + rank), for an outside router",
    )
    p.add_argument("--host", default="127.0.0.1", help="address the API servers listen on")
    p.add_argument("--port", type=int, default=8000, help="port the API servers listen on (default 8000)")
    p.add_argument(
        "--backend",
        choices=["ray", "mp"],
        default="ray",
        help="ray (default): actors on the Ray cluster; mp: local processes, no Ray",
    )
    p.add_argument("--address", default=None, help="Ray address (default: ambient cluster or a local one)")
    p.add_argument(
        "--fail-stop",
        action="store_true",
        help="no restarts, and stop serving at the first death of any rank (for a batch job that must not "
        "run short); the default restarts a dead rank and serves on without it once its budget is spent",
    )
    p.add_argument(
        "--graceful-shutdown-s",
        type=float,
        default=None,
        metavar="S",
        help="on SIGTERM or Ctrl-C, running requests get S seconds to finish, then a 503 "
        "(default 3; internal mode only)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="a local Hugging Face tokenizer (or model) directory: the API servers encode text "
        "prompts, detokenize outputs and serve POST /v1/chat/completions with it and its chat "
        "template (default: the byte tokenizer, one token per UTF-8 byte, no chat; a vLLM engine's "
        "--model); hybrid and external modes need it at this path on every node",
    )
    p.add_argument(
        "--balancer",
        choices=list(POLICIES),
        default=None,
        help="how the API servers pick a rank: least-loaded (default), prefix (the rank that holds "
        "the prompt's prefix in its cache, unless it is busier than the least-loaded one by a "
        "margin), power-of-two, round-robin",
    )
    p.add_argument(
        "--no-adapter-affinity",
        dest="adapter_affinity",
        action="store_false",
        default=None,
        help="route LoRA adapters' requests adapter-blind (default: to the ranks that hold the adapter, "
        "unless they are busier than the least-loaded one by a margin)",
    )
    p.add_argument(
        "--prefix-load-margin",
        type=int,
        default=None,
        metavar="SCORE",
        help="with --balancer prefix: a prompt leaves its prefix's rank once that rank is busier than "
        "the least-loaded one by SCORE (4 per waiting request, 1 per running one; default 16)",
    )
    p.add_argument(
        "--migration-limit",
        type=int,
        default=None,
        metavar="N",
        help="a stream whose rank dies mid-stream moves to a live rank and goes on from its last "
        "token, at most N times (default 0: it fails with the rank's error)",
    )
    p.add_argument(
        "--autoscale",
        default=None,
        metavar="MIN:MAX",
        help="change the number of ranks (a P/D cluster: of decode ranks) with the load, between MIN and MAX "
        "(Ray Serve's defaults: 2 ongoing "
        "requests per rank, 30 s before adding, 600 s before removing, a 30 s window; set them with "
        'RAYDP_AUTOSCALING=\'{"min_dp_size": 1, "max_dp_size": 4, "upscale_delay_s": 10}\')',
    )
    p.add_argument(
        "--prefill-autoscale",
        default=None,
        metavar="MIN:MAX",
        help="a P/D cluster: change the number of prefill ranks with their load (ongoing prefills), "
        "between MIN and MAX (the same defaults as --autoscale; set them with RAYDP_PREFILL_AUTOSCALING)",
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every /v1/* request (repeat for several keys; "
        "default: $RAYDP_API_KEY, which keeps the key out of the process list); /health stays open",
    )
    p.add_argument(
        "--protect-metrics",
        action="store_true",
        help="GET /metrics needs an API key too (default: open, for Prometheus)",
    )
    p.add_argument(
        "--ssl-certfile",
        default=None,
        metavar="PEM",
        help="serve HTTPS with this certificate (chain); hybrid and external modes need the PEM files "
        "at these paths on every node",
    )
    p.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="the private key of --ssl-certfile")
    p.add_argument(
        "--ssl-ca-certs",
        default=None,
        metavar="PEM",
        help="require client certificates signed by these CAs (mutual TLS)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args, CONFIG_FLAGS, PRESETS)
    vllm_flags.start_fork_server_early(config.engine, args)
    config = with_engine_flags(config, args, {})
    if args.fail_stop:
        if getattr(args, "max_restarts", 0):
            raise ConfigError(
                f"--max-restarts={args.max_restarts!r}: --fail-stop restarts nothing; give one of the two"
            )
        config = config.with_changes(max_restarts=0)
    config = autoscaled(config, args)
    if config.pooled and args.lb_mode != "internal":
        raise ConfigError(
            f"--lb-mode={args.lb_mode}: P/D pools need API servers that reach both pools; use --lb-mode internal"
        )
    settings = _server_settings(args, config.engine)
    cluster, urls = _start(config, args, settings)
    with cluster:
        print(
            f"raydp {cluster.name}: {cluster.dp_size} ranks{pools_note(config)}, {args.lb_mode} API servers at "
            f"{' '.join(urls)} (POST /v1/completions, /v1/chat/completions); Ctrl-C to stop",
            flush=True,
        )
        serve_until_down(cluster, fail_stop=args.fail_stop)  # a stop signal raises here; the with-block closes
    return 0


def _start(config: RaydpConfig, args: argparse.Namespace, settings: ServerSettings) -> tuple[Any, list[str]]:
    """Launch, start the API servers and see every rank generate: the cluster and its URLs.

    A start that fails or wedges (``StartupError``) is tried again, whole,
    under the restart budget (``max_restarts`` within ``restart_window_s``,
    the backoff doubling): nothing was served yet, so nothing is lost, and a
    transient wedge (vllm#53157: 5 of 7 startups) passes on a later try.
    ``--fail-stop`` tries once.
    """
    from raydp.api import launch

    budget = RestartBudget(
        config.max_restarts,
        [0],
        window_s=config.restart_window_s,
        backoff_s=config.restart_backoff_s,
        backoff_max_s=config.restart_backoff_max_s,
    )
    while True:
        cluster = None
        try:
            cluster = launch(config, backend=args.backend, address=args.address)
            install_stop_handlers()  # again: ray.init sets a SIGTERM handler of its own
            urls = _start_api_servers(cluster, args, settings)
            _first_generation(cluster, config.startup_timeout_s)
            return cluster, urls
        except StartupError as exc:
            if cluster is not None:
                cluster.close()
            delay = budget.take(0)
            if delay is None:
                raise
            logger.warning("raydp serve: the start of cluster %r failed: %s", config.name, exc)
            print(f"raydp {config.name}: the start failed ({_gist(exc)}); trying again in {delay:g}s", flush=True)
            time.sleep(delay)
        except BaseException:
            if cluster is not None:
                cluster.close()
            raise


def _gist(exc: BaseException) -> str:
    """An error's message without its stacks: its first line and its last unindented one."""
    said = [line for line in str(exc).splitlines() if line.strip() and not line[0].isspace()]
    said = [line for line in said if not line.startswith("Traceback")] or [repr(exc)]
    return (said[0] if len(said) == 1 else f"{said[0]} {said[-1]}")[:400]


def _first_generation(cluster: Any, timeout_s: float) -> None:
    """Every rank generates one token before the banner: a rank that loaded but cannot generate fails startup."""
    with cluster.client() as client:
        handles = [client.submit(PROBE_PROMPT, max_tokens=1, rank=rank) for rank in range(cluster.dp_size)]
        for rank, handle in enumerate(handles):
            try:
                handle.result(timeout=timeout_s)
            except TimeoutError:
                raise StartupError(
                    f"engine rank {rank} generated no token within startup_timeout_s={timeout_s:g}"
                ) from None


def serve_until_down(cluster: Any, fail_stop: bool) -> None:
    """Wait, saying each rank death as it comes; raise once the service is down (see the command's help)."""
    if fail_stop:
        cluster.wait()
        return
    said = 0
    while True:
        cluster.wait(timeout=0.5, degraded_ok=True)
        deaths = cluster.deaths
        for death in deaths[said:]:
            _say_death(cluster, death, deaths)
        said = len(deaths)


def _say_death(cluster: Any, death: Exception, deaths: list[Any]) -> None:
    """A rank down for good leaves the service degraded: say so (the death itself is logged already)."""
    if getattr(death, "restarting", False) or not isinstance(death, EngineDeadError):
        return
    down = {d.rank for d in deaths if isinstance(d, EngineDeadError) and not d.restarting}
    print(
        f"raydp {cluster.name}: engine rank {death.rank} stays down (its restart budget is spent): serving degraded "
        f"on {cluster.dp_size - len(down)} of {cluster.dp_size} ranks",
        flush=True,
    )


def _server_settings(args: argparse.Namespace, engine: object = None) -> ServerSettings:
    """Checked before anything is launched."""
    vllm_args = _vllm_frontend(args) if is_vllm(engine) else ()
    fields: dict[str, Any] = {
        "vllm_args": vllm_args or None,
        "graceful_shutdown_s": args.graceful_shutdown_s,
        "tokenizer": None if vllm_args else _tokenizer(args),
        "api_keys": _api_keys(args),
        "protect_metrics": args.protect_metrics,
        "ssl_certfile": args.ssl_certfile,
        "ssl_keyfile": args.ssl_keyfile,
        "ssl_ca_certs": args.ssl_ca_certs,
        "migration_limit": args.migration_limit,
        "balancer": args.balancer,
        "prefix_load_margin": args.prefix_load_margin,
        "adapter_affinity": args.adapter_affinity,
    }
    # The other modes' servers stop with their host actor, which has no grace period to give.
    if args.graceful_shutdown_s is not None and args.lb_mode != "internal":
        raise ConfigError(
            f"--graceful-shutdown-s={args.graceful_shutdown_s!r}: applies to --lb-mode internal "
            f"only, not {args.lb_mode}"
        )
    settings = ServerSettings(**{name: value for name, value in fields.items() if value is not None})
    if settings.tokenizer is not None:
        from raydp.text.tokenizer import load_tokenizer

        load_tokenizer(settings.tokenizer)  # a directory without a tokenizer fails here, not in every server
    return settings


def _vllm_frontend(args: argparse.Namespace) -> tuple[str, ...]:
    """vllm serve's flags for API servers that run vLLM's own front-end (raydp's --tokenizer is vLLM's there)."""
    for flag, value in (
        ("--graceful-shutdown-s", args.graceful_shutdown_s),
        ("--protect-metrics", args.protect_metrics),
    ):
        if value:
            instead = "--shutdown-timeout" if flag == "--graceful-shutdown-s" else "a proxy in front of /metrics"
            raise ConfigError(f"{flag}={value!r}: raydp's own server only; vLLM's front-end takes {instead}")
    flags = list(getattr(args, "engine_flags", []))
    if args.tokenizer is not None:
        flags += ["--tokenizer", args.tokenizer]
    return vllm_flags.frontend_flags(args.model, flags)


def _api_keys(args: argparse.Namespace) -> list[Any]:
    if args.api_key:
        return list(args.api_key)
    env_key = ServeEnvironment().api_key
    return [env_key] if env_key is not None else []


def _tokenizer(args: argparse.Namespace) -> str | None:
    """The API servers' tokenizer directory (None: the byte tokenizer); a vLLM engine's model by default."""
    tokenizer: str | None = args.tokenizer
    if tokenizer is None and getattr(args, "model", None):
        return str(args.model)
    return tokenizer


def _start_api_servers(cluster: Any, args: argparse.Namespace, settings: ServerSettings) -> list[str]:
    if args.lb_mode == "hybrid":
        return [s.url for s in cluster.serve_api_per_node(args.api_servers, port=args.port, settings=settings)]
    if args.lb_mode == "external":
        return [s.url for s in cluster.serve_api_per_rank(port=args.port, settings=settings)]
    return [cluster.serve_api(args.api_servers, host=args.host, port=args.port, settings=settings).url]
