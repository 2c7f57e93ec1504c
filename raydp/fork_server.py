"""Children forked from a fork server that has imported the engine's modules, where that is safe.

A vLLM process spends ~10 CPU-seconds importing torch's compiler stack and
transformers before any work. :func:`child_context` gives the callers of
:func:`raydp.processes.spawn` multiprocessing's ``forkserver`` context, whose
server (a fresh interpreter: nothing of this process, its threads, Ray or
ZMQ, is forked) imports the named modules once; each child is then a fork of
it. A process has one fork server, and the first caller's preload is the
one it keeps: a later caller naming other modules still forks from it and
imports them itself.

Where a GPU driver's device nodes exist children are always spawned: CUDA
must never be initialised in a process that forks, and the forked path has
not run on a GPU. A fork server that exits before it forks (a preloaded
module raised) is given up: this process spawns its children from then on.

The server runs in this process's process group, and multiprocessing learns
each forked child's exit through it: a server ended by a signal sent to the
group (``timeout``, ``kill -- -PGID``, a closed terminal, a service
manager's stop) would make every live child look exited. So it starts with
SIGTERM and SIGHUP blocked (it already ignores SIGINT) and ends when this
process does; its children unblock them first thing
(:data:`HELD_SIGNALS`). No Ray here.
"""

from __future__ import annotations

import glob
import logging
import multiprocessing as mp
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import forkserver, resource_tracker
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

logger = logging.getLogger("raydp.processes")
# Device nodes of the GPU drivers (NVIDIA's, AMD's): where any exists, children are spawned.
GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/nvidia[0-9]*", "/dev/kfd")
HELD_SIGNALS = frozenset({signal.SIGTERM, signal.SIGHUP})  # blocked in the server, unblocked in each child


@dataclass
class _State:
    """This process's one fork server: what it preloads (set once), and whether it was given up."""

    lock: threading.Lock
    preload: tuple[str, ...] | None = None
    failed: bool = False


_state = _State(threading.Lock())


def child_context(preload: Sequence[str] = ()) -> BaseContext:
    """``forkserver``, its server importing ``preload``, where allowed (module docstring); else ``spawn``."""
    usable = "forkserver" in mp.get_all_start_methods() and not gpu_driver_present()
    if not preload or not usable or _state.failed:
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    with _state.lock:
        if _state.preload is None:
            context.set_forkserver_preload(list(preload))
            _state.preload = tuple(preload)
    return context


def start_early(preload: Sequence[str]) -> bool:
    """Start this process's fork server now, importing ``preload`` while this process goes on with other
    work (its own imports), so that the first child need not wait for them; whether one was started."""
    if child_context(preload).get_start_method() != "forkserver":
        return False
    _ensure_running()  # a preload that raises ends the server: start_process then spawns (module docstring)
    return True


def gpu_driver_present() -> bool:
    """Whether a GPU driver's device nodes exist here (then :func:`child_context` always spawns)."""
    return any(glob.glob(pattern) for pattern in GPU_DEVICE_NODES)


def start_process(context: Any, make: Callable[[Any], BaseProcess]) -> tuple[BaseProcess, bool]:
    """Start the process ``make(context)`` builds (from a multiprocessing context); spawned instead where the
    fork server was given up. Also says whether it was forked from the fork server."""
    forked = context.get_start_method() == "forkserver"
    if forked and not _state.failed:
        process = make(context)
        try:
            _ensure_running()
            process.start()
            return process, True
        except (EOFError, OSError):
            # The server exited before it forked: a preloaded module raised (its traceback is on stderr).
            # A spawned child imports the module itself, and fails with the reason where the import is bad.
            _state.failed = True
            logger.warning("the fork server preloading %s exited; spawning children instead", _state.preload)
    process = make(mp.get_context("spawn") if forked else context)
    process.start()
    return process, False


def _ensure_running() -> None:
    # A (re)started server inherits this thread's signal mask; blocked, not ignored, so that this process
    # loses no SIGTERM that comes meanwhile: it is delivered here once the mask is restored.
    # The resource tracker first: its own start unblocks SIGTERM in the starting thread when it is done.
    resource_tracker.ensure_running()
    held = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
    try:
        forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
