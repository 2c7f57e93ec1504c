#!/usr/bin/env python3
"""Bootstrap and run raydp with nothing installed but Python 3.10+.

    python3 scripts/bootstrap.py demo [demo flags]   # `raydp demo` on an embedded local Ray
    python3 scripts/bootstrap.py test [pytest args]  # ruff + mypy + import contracts + the whole test suite
    python3 scripts/bootstrap.py bench [bench flags] # the benchmarks (adds Ray Serve)

Creates ``.venv`` if missing and installs what is missing, pinned by
``constraints.txt``; a stamp of the inputs makes every later run skip the
install, so the command is idempotent and quick the second time.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
BIN = VENV / "bin"
EXTRAS = {"demo": "", "test": "test", "bench": "test,bench"}


def sh(*cmd: str | Path, check: bool = True) -> int:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], cwd=ROOT, check=check).returncode


def ensure_env(extras: str) -> None:
    if not (BIN / "python").exists():
        venv.EnvBuilder(with_pip=True).create(VENV)
    inputs = b"".join((ROOT / f).read_bytes() for f in ("pyproject.toml", "constraints.txt"))
    stamp = VENV / f".raydp-stamp-{extras or 'base'}"
    digest = hashlib.sha256(inputs).hexdigest()
    if stamp.exists() and stamp.read_text() == digest:
        return
    target = f".[{extras}]" if extras else "."
    pip = [BIN / "python", "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    wheels = Path("/opt/wheels")  # a local wheel cache, where the machine has one
    if wheels.is_dir():
        pip += ["--find-links", wheels]
    sh(*pip, "-c", "constraints.txt", "-e", target)
    stamp.write_text(digest)


def run_tests(args: list[str]) -> int:
    py = BIN / "python"
    sh(py, "-m", "ruff", "check", ".")
    sh(py, "-m", "mypy")
    sh(BIN / "lint-imports")  # the layering contracts in pyproject.toml
    code = sh(py, "-m", "pytest", *(args or ["tests"]), check=False)
    if code == 5:  # pytest: no tests collected
        print("no tests were collected", file=sys.stderr)
        return 1
    return code


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in EXTRAS:
        print(__doc__, file=sys.stderr)
        return 2
    command, rest = sys.argv[1], sys.argv[2:]
    ensure_env(EXTRAS[command])
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if command == "test":
        return run_tests(rest)
    if command == "bench":
        return sh(BIN / "python", "scripts/bench.py", *rest, check=False)
    return sh(BIN / "raydp", "demo", *rest, check=False)


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except subprocess.CalledProcessError as exc:
        raise SystemExit(exc.returncode) from None
