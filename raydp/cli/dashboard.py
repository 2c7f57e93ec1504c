"""``raydp dashboard``: write raydp's Grafana dashboard (JSON), to load into Ray's Grafana or any other."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    """Register the ``dashboard`` subcommand on an argparse subparsers object."""
    p = sub.add_parser(
        "dashboard",
        help="print raydp's Grafana dashboard JSON (or write it to a file)",
        description="The Grafana dashboard for raydp clusters: HTTP requests, errors, latency and time to "
        "first token from the API servers; per-rank load, deaths, restarts and the wave from Ray's metrics "
        "export. It reads a Prometheus data source chosen on import; see docs/operations.md, Prometheus and Grafana.",
    )
    p.add_argument("-o", "--output", default=None, metavar="FILE", help="write it to FILE (default: stdout)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from raydp.dashboard import render

    text = render()
    if args.output is None:
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)
        print(f"wrote {args.output}", file=sys.stderr)
    return 0
