"""The ``raydp`` command line.

Each command is a module with ``add_parser`` and ``run``; :func:`main` parses
and dispatches. The CLI sits at the top of the layering and may import any of
raydp.

Modules:

- ``demo``: ``raydp demo``, DP=2 on an embedded local Ray, a few hundred requests, a summary;
- ``serve``: ``raydp serve``, a cluster and N HTTP API servers, watched until a death or a signal;
- ``plan``: ``raydp plan``, where each rank would go, creating nothing;
- ``status``: ``raydp status [NAME]``, a running cluster as its coordinator reports it;
- ``scale``: ``raydp scale NAME N``, growing or shrinking a running detached cluster;
- ``make_model``: ``raydp make-model``, the small offline Llama checkpoint;
- ``dashboard``: ``raydp dashboard``, raydp's Grafana dashboard as JSON;
- ``options``: the cluster flags, made from ``RaydpConfig``'s fields;
- ``vllm_flags``: vLLM's own engine flags, passed through for ``--engine vllm``;
- ``signals``: stopping a foreground command on SIGTERM as on Ctrl-C.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence

from raydp.cli import dashboard, demo, make_model, plan, scale, serve, status
from raydp.cli.signals import Stop, install_stop_handlers
from raydp.errors import RaydpError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raydp", description="Data-parallel engine cores on a Ray cluster.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo.add_parser(sub)
    serve.add_parser(sub)
    plan.add_parser(sub)
    status.add_parser(sub)
    scale.add_parser(sub)
    make_model.add_parser(sub)
    dashboard.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # serve and demo hand flags they do not know to vLLM's own parser (--engine vllm).
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "engine_flags_ok", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.engine_flags = extra
    _say_auth_mode(args.command)
    if args.command in ("serve", "demo"):  # long-running: SIGTERM stops them as Ctrl-C does
        install_stop_handlers()
    try:
        code: int = args.run(args)
    except RaydpError as exc:
        print(f"raydp {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Stop) else signal.SIGINT
        print(
            f"raydp {args.command}: stopped by {signal.Signals(signum).name}; everything was shut down", file=sys.stderr
        )
        return 128 + signum
    return code


def _say_auth_mode(command: str) -> None:
    """The one line naming the Ray cluster's authentication mode (:mod:`raydp.actors.connection`), on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"raydp {command}: %(message)s"))
    auth = logging.getLogger("raydp.auth")
    auth.handlers = [handler]
    auth.setLevel(logging.INFO)
    auth.propagate = False
