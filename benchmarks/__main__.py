"""``python -m benchmarks``: run the sections asked for and print their tables (see :mod:`benchmarks`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import benchmarks
from benchmarks import report
from benchmarks.sections import BY_NAME, SECTIONS, Section, pick


def section_names(value: str) -> list[str]:
    """``--only``/``--skip``'s value: one name or a comma list, each a section's name or alias."""
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown section {unknown or value!r}: one of {', '.join(BY_NAME)}")
    return names


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=(benchmarks.__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke test in about a minute")
    names = ", ".join(s.name + (" (opt-in)" if s.opt_in else "") for s in SECTIONS)
    parser.add_argument(
        "--only",
        action="append",
        type=section_names,
        metavar="SECTION",
        help=f"run only these sections (repeatable, or a comma list): {names}",
    )
    parser.add_argument(
        "--skip",
        action="append",
        type=section_names,
        metavar="SECTION",
        help="leave these sections out (repeatable, or a comma list)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write every number to this JSON file")
    parser.add_argument("--plot", metavar="DIR", help="also draw every table as PNG charts in DIR (matplotlib)")
    args = parser.parse_args(argv)
    args.sections = pick(_flat(args.only), _flat(args.skip))
    if not args.sections:
        parser.error("--only and --skip leave no section to run")
    return args


def _flat(lists: list[list[str]] | None) -> list[str] | None:
    return None if lists is None else [n for names in lists for n in names]


def run(sections: list[Section[Any]], quick: bool) -> dict[str, Any]:
    """Every section's result, by name; the bench's own local Ray is up while a section that needs it runs."""
    import ray

    results: dict[str, Any] = {}
    try:
        for section in sections:
            if section.needs_ray and not ray.is_initialized():
                # address="local": always a fresh Ray of our own, never one found via RAY_ADDRESS
                # or /tmp/ray/ray_current_cluster (another user's cluster on this machine).
                ray.init(address="local", num_cpus=4, num_gpus=4, include_dashboard=False, log_to_driver=False)
            elif section.own_ray and ray.is_initialized():
                ray.shutdown()  # it connects this process to a Ray of its own
            results[section.name] = section.run(quick)
    finally:
        if ray.is_initialized():
            ray.shutdown()
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env = report.environment(args.quick, args.sections)
    start = time.perf_counter()
    results = run(args.sections, args.quick)
    env["wall_s"] = round(time.perf_counter() - start, 1)
    tables = report.tables(args.sections, results, args.quick)
    report.print_report(env, tables)
    print()
    print(f"(ran in {env['wall_s']} s)")
    if args.json:
        payload = report.as_json(env, args.sections, results, args.quick)
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    if args.plot:
        from benchmarks.plot import plot_sections

        for path in plot_sections(tables, Path(args.plot)):
            print(f"wrote {path}")
    return 1 if report.failed(args.sections, results) else 0


if __name__ == "__main__":
    sys.exit(main())
