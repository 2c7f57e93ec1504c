"""Servers for :mod:`benchmarks.vllm_dp`: start one under a supervisor, find its engine processes, stop it for sure.

Each server runs under a small supervisor process (``SUPERVISOR``) that gets
SIGTERM if the bench dies in any way (``PR_SET_PDEATHSIG``), passes it on, and
SIGKILLs its process group if the server outlasts the grace: vLLM's server
hangs when a SIGTERM reaches it during its startup. :meth:`Server.stop` then
kills whatever is still alive below it, Ray's workers (sessions of their own)
included.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from benchmarks.common import log

REPO = Path(__file__).resolve().parents[2]
DP_SIZE = 2


def server_command(system: str, model: str, port: int, name: str, flags: list[str]) -> list[str]:
    """The same DP size, engine flags, host and port for both systems; raydp restarts a killed rank."""
    if system == "raydp":
        return [
            sys.executable,
            "-m",
            "raydp",
            "serve",
            "--engine",
            "vllm",
            "--model",
            model,
            "--address",
            "local",
            "--dp-size",
            str(DP_SIZE),
            "--api-servers",
            "1",
            "--accelerator",
            "CPU",
            "--max-restarts",
            "1",
            "--migration-limit",  # a stream cut by the fault turn's kill goes on on the other rank
            "1",
            "--step-timeout-s",  # the hang turn's bound (the default, 300 s, is vLLM's own execute_model bound)
            str(STEP_TIMEOUT_S),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--name",
            name,
            *flags,
        ]
    if system == "serve-llm":
        return [sys.executable, "-m", "benchmarks.vllm_dp.serve_llm", model, str(port), str(DP_SIZE), *flags]
    # vllm: its own DP=2 (engine cores in its multiprocessing); vllm-ray: the same over Ray, the seeds' system.
    backend = ["--data-parallel-backend", "ray"] if system == "vllm-ray" else []
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--data-parallel-size",
        str(DP_SIZE),
        *backend,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *flags,
    ]


STOP_GRACE_S = 30  # SIGTERM to SIGKILL, in s
STEP_TIMEOUT_S = 15  # raydp's: a rank's loop turn past it is a hang


# Every server runs under this supervisor, which gets SIGTERM (PR_SET_PDEATHSIG, 1) if the bench dies in any
# way, even by SIGKILL. It passes SIGTERM on and SIGKILLs its group (itself too) if the server outlasts the
# grace: a SIGTERM alone is not enough, as vLLM's server hangs when one reaches it during its startup. The
# handler only signals: a wait in it would wait on the lock of the main thread's wait.
SUPERVISOR = (
    "import ctypes, os, signal, subprocess, sys\n"
    "ctypes.CDLL(None).prctl(1, signal.SIGTERM)\n"
    "child = subprocess.Popen(sys.argv[1:])\n"
    "def stop(*_):\n"
    "    os.kill(child.pid, signal.SIGTERM)\n"
    f"    signal.alarm({STOP_GRACE_S - 5})\n"
    "signal.signal(signal.SIGTERM, stop)\n"
    "signal.signal(signal.SIGALRM, lambda *_: os.killpg(0, signal.SIGKILL))\n"
    "rc = child.wait()\n"
    "sys.exit(rc if rc >= 0 else 128 - rc)\n"
)


class ServerError(RuntimeError):
    """A server did not start, or a process to kill was not found."""


def server_env(omp_threads: int) -> dict[str, str]:
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "RAY_USAGE_STATS_ENABLED": "0",
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        # Ray gives raydp's rank actors (num_cpus=1) OMP_NUM_THREADS=1 unless the variable is set; vLLM's
        # engine cores would take every core each, and two of them oversubscribe a small machine (10x
        # slower on 2 cores). The same thread count for both: an engine is an engine.
        "OMP_NUM_THREADS": str(omp_threads),
    }
    # vLLM's DP needs its multiprocessing; raydp sets its own default in each rank.
    for name in ("VLLM_ENABLE_V1_MULTIPROCESSING", "RAY_ADDRESS"):
        env.pop(name, None)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Server:
    """A server process and every process seen below it (a crash orphans some: they are remembered)."""

    system: str
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    spawned: float
    ignore_eos: bool = True
    seen: dict[int, psutil.Process] = field(default_factory=dict)
    stop_s: float | None = None  # SIGTERM to the exit
    stop_forced: bool = False  # the grace ran out: SIGKILL

    def refresh(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(child.pid, child)
        return [p for p in self.seen.values() if alive(p)]

    def log_tail(self, chars: int = 1500) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> list[str]:
        """SIGTERM (a clean stop), then SIGKILL the group and all descendants; what is still alive after."""
        self.refresh()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            start = time.monotonic()
            while self.proc.poll() is None and time.monotonic() < start + STOP_GRACE_S:
                self.refresh()  # a rank restarted meanwhile is new
                time.sleep(0.2)
            self.stop_s = time.monotonic() - start
            # The supervisor SIGKILLs its group (itself too) when the server outlasts its grace.
            self.stop_forced = self.proc.poll() in (None, -signal.SIGKILL)
            log(f"{self.system}: stopped {self.stop_s:.1f} s after SIGTERM{' (SIGKILL)' if self.stop_forced else ''}")
        # A group signal: the server's own children; the list: Ray workers, which have sessions of their own.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for p in self.refresh():
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        psutil.wait_procs(list(self.seen.values()), timeout=10)
        return [f"{p.pid} {title_of(p)[:60]}" for p in self.seen.values() if alive(p)]


def alive(p: psutil.Process) -> bool:
    try:
        return bool(p.is_running() and p.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def title_of(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline()) or p.name()
    except psutil.Error:
        return "?"


def spawn(
    system: str,
    model: str,
    flags: list[str],
    log_dir: Path,
    tag: str,
    omp_threads: int = 1,
    extra_env: dict[str, str] | None = None,
) -> Server:
    name = f"bv{os.getpid()}{tag}"
    port = free_port()
    log_path = log_dir / f"{system}-{tag}.log"
    spawned = time.monotonic()
    with log_path.open("wb") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [sys.executable, "-c", SUPERVISOR, *server_command(system, model, port, name, flags)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**server_env(omp_threads), **(extra_env or {})},
            cwd=REPO,
            start_new_session=True,
        )
    log(f"{system} {tag}: started pid {proc.pid} on port {port} (log {log_path})")
    return Server(system, name, proc, f"http://127.0.0.1:{port}", log_path, spawned)
