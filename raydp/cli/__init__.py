"""The ``raydp`` command line: ``raydp demo``, ``serve``, ``plan``, ``status`` and ``scale``."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from raydp.cli import demo, plan, scale, serve, status
from raydp.cli.signals import Stop, install_stop_handlers
from raydp.errors import RaydpError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raydp", description="Data-parallel engine cores on a Ray cluster."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo.add_parser(sub)
    serve.add_parser(sub)
    plan.add_parser(sub)
    status.add_parser(sub)
    scale.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("serve", "demo"):  # long-running: SIGTERM stops them as Ctrl-C does
        install_stop_handlers()
    try:
        code: int = args.run(args)
    except RaydpError as exc:
        print(f"raydp {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        signum = exc.signum if isinstance(exc, Stop) else signal.SIGINT
        print(f"raydp {args.command}: stopped by {signal.Signals(signum).name}; everything was shut down",
              file=sys.stderr)
        return 128 + signum
    return code
