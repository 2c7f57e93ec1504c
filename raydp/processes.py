"""Local child processes: spawn with a parent-death pipe, watch their exits, shut them down.

Shared by the multiprocessing backend (:mod:`raydp.local`) and the HTTP API
servers (:mod:`raydp.serve`). Children are spawned (no forked Ray or ZMQ
state), or, for engines that name modules to preload, forked from a fork
server that has imported them (:mod:`raydp.fork_server`). Each is a daemon
in a process group of its own: a terminal's Ctrl-C reaches the launcher
alone, which stops them in order (API servers answer their running requests
before the engines go). Each holds the read end of a parent-death pipe: when
the parent dies, however it died, the pipe closes and the child shuts down.
:func:`shutdown` terminates, waits out a grace period, then kills the whole
process tree.

A forked child's exit reaches this process through its fork server, so a
server killed alone (the OOM killer, a stray ``kill -9``) makes each of its
live children look exited (multiprocessing reads exit code 255). Such a
child would serve on beside the successor it gets: the watcher and
:func:`shutdown` kill it and wait until it is gone, and report it as killed
(:attr:`Proc.orphaned`). No Ray here.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from raydp.errors import describe_exit
from raydp.fork_server import HELD_SIGNALS, start_process

logger = logging.getLogger("raydp.processes")
GRACE_S = 5.0
WATCH_TIMEOUT_S = 0.05
LOST_SERVER_EXIT = 255  # what multiprocessing reads as a forked child's exit code once its fork server is gone


@dataclass
class Proc:
    """A child process and what to call it in errors."""

    name: str
    process: BaseProcess
    rank: int | None = None
    death_pipe: Connection | None = None
    started: int | None = None  # a forked child's start (start_ticks), to know it again once its server is gone
    orphaned: bool = False  # it outlived its fork server, and was killed for it (module docstring)

    @property
    def exitcode(self) -> int | None:
        """Its exit code; an orphan's is SIGKILL's (multiprocessing's 255 only says the server went)."""
        return -int(signal.SIGKILL) if self.orphaned else self.process.exitcode

    def exit_text(self) -> str:
        """'exit code 3', or for an orphan, why it was killed."""
        text = describe_exit(self.exitcode)
        return f"{text}: raydp killed it once its fork server died" if self.orphaned else text


def spawn(mp_ctx: Any, name: str, target: Callable[..., None], *args: Any, rank: int | None = None) -> Proc:
    """Start ``target(*args, death_pipe)`` as a daemon process; the parent keeps the pipe's writer.

    The child watches the reader: it ends when the parent goes, however the parent died.
    """
    # Duplex, so that the child can leave its last words (why it failed) before it exits.
    reader, writer = mp_ctx.Pipe(duplex=True)
    # A forked child has its fork server's environment: it takes this process's, as a spawned one has.
    env = dict(os.environ)
    process, forked = start_process(
        mp_ctx, lambda ctx: ctx.Process(target=_in_own_group, args=(env, target, *args, reader), name=name, daemon=True)
    )
    reader.close()
    return Proc(name, process, rank, writer, start_ticks(process.pid) if forked else None)


def start_ticks(pid: int | None) -> int | None:
    """When process ``pid`` started, in clock ticks since boot: unlike a wall-clock start time, no clock
    step changes it. None where it is gone, or where there is no ``/proc`` (then orphans go unnoticed)."""
    stat = _stat(pid)
    return stat[1] if stat is not None else None


def _stat(pid: int | None) -> tuple[bytes, int] | None:
    """Process ``pid``'s state letter and start ticks, from ``/proc/PID/stat`` (fields 3 and 22 of proc(5))."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()  # after the name, which may hold spaces and parentheses
    return fields[0], int(fields[19])


def _runs(pid: int | None, started: int) -> bool:
    """Whether the process ``pid`` that started at ``started`` still runs (a zombie has ended)."""
    stat = _stat(pid)
    return stat is not None and stat[1] == started and stat[0] != b"Z"


def _in_own_group(env: dict[str, str], target: Callable[..., None], *args: Any) -> None:
    os.setpgid(0, 0)  # out of the terminal's foreground group: see the module docstring
    signal.pthread_sigmask(signal.SIG_UNBLOCK, HELD_SIGNALS)  # a fork server's child: see raydp.fork_server
    if os.environ != env:
        os.environ.clear()
        os.environ.update(env)
    target(*args)


def shutdown(procs: Sequence[Proc], grace_s: float = GRACE_S) -> None:
    """Terminate, wait up to ``grace_s``, then kill every survivor and its children."""
    for p in procs:
        end_orphan(p, timeout_s=max(grace_s, 1.0))  # killed at once: the wait ends as soon as it is gone
    alive = [p for p in procs if p.process.is_alive()]
    for p in alive:
        p.process.terminate()
    deadline = time.monotonic() + grace_s
    pending = [p.process.sentinel for p in alive]
    while pending and time.monotonic() < deadline:  # wait() returns at the first exit
        ready = wait(pending, timeout=max(0.0, deadline - time.monotonic()))
        pending = [s for s in pending if s not in ready]
    for p in alive:
        if p.process.is_alive():
            _kill_tree(p.process.pid)
        p.process.join(timeout=grace_s)
    for p in procs:
        if p.death_pipe is not None:
            p.death_pipe.close()


def _kill_tree(pid: int | None) -> None:
    if pid is None:
        return
    import psutil

    try:
        root = psutil.Process(pid)
        victims = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for proc in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()


def end_orphan(proc: Proc, timeout_s: float = GRACE_S) -> bool:
    """If ``proc`` looks exited only because its fork server died, kill it and its children and wait (up to
    ``timeout_s``) until it is gone; whether it was such an orphan."""
    if proc.orphaned:
        return True
    pid, started = proc.process.pid, proc.started
    if pid is None or started is None or proc.process.exitcode != LOST_SERVER_EXIT or not _runs(pid, started):
        return False  # not forked, or it did exit (with 255), or the pid is another process's now
    proc.orphaned = True
    logger.warning("%s (pid %d) outlived its fork server: killing it", proc.name, pid)
    _kill_tree(pid)
    deadline = time.monotonic() + timeout_s
    while _runs(pid, started) and time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):  # this process's child only where it adopts orphans
            os.waitpid(pid, os.WNOHANG)  # (PID 1, a subreaper): reaped here, or it stays a zombie
        time.sleep(0.01)
    if _runs(pid, started):
        logger.error("%s (pid %d) still runs %.1f s after its SIGKILL", proc.name, pid, timeout_s)
    return True


def watch_processes(
    procs: Sequence[Proc], stop: threading.Event, on_exit: Callable[[Proc], None], name: str
) -> threading.Thread:
    """Call ``on_exit(proc)`` as each process exits (or leaves its last words), until ``stop`` is set.

    A child that fails says why on its death pipe before it tears down, and
    that counts as its death: the report does not wait for a slow exit.
    A bound ``on_exit`` is held weakly, so the watcher never keeps its manager
    alive: dropping the manager still runs its finalizer.
    """
    ref: Callable[[], Callable[[Proc], None] | None] = (
        weakref.WeakMethod(on_exit) if inspect.ismethod(on_exit) else (lambda: on_exit)
    )

    def run() -> None:
        alive: dict[Any, Proc] = {p.process.sentinel: p for p in procs}
        alive.update({p.death_pipe: p for p in procs if p.death_pipe is not None})
        while alive and not stop.is_set():
            for ready in wait(list(alive), timeout=WATCH_TIMEOUT_S):
                proc = alive.pop(ready, None)
                if proc is None:
                    continue  # its other handle fired in this same round
                alive = {k: p for k, p in alive.items() if p is not proc}
                end_orphan(proc)
                callback = ref()
                if stop.is_set() or callback is None:
                    return
                try:
                    callback(proc)
                except Exception:
                    logger.exception("reporting the exit of %s failed", proc.name)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def watch_parent(death_pipe: Connection, on_parent_death: Callable[[], None]) -> None:
    """In a child: call ``on_parent_death`` once the parent's end of the pipe closes."""

    def watcher() -> None:
        with contextlib.suppress(EOFError, OSError):
            death_pipe.recv()
        on_parent_death()

    threading.Thread(target=watcher, name="raydp-parent-watch", daemon=True).start()


def leave_last_words(death_pipe: Connection, words: bytes) -> None:
    """In a child about to fail: tell the parent why, on the parent-death pipe."""
    with contextlib.suppress(OSError, ValueError):
        death_pipe.send_bytes(words)


def last_words(proc: Proc) -> bytes | None:
    """What a dead child said with :func:`leave_last_words`, if anything."""
    pipe = proc.death_pipe
    try:
        return pipe.recv_bytes() if pipe is not None and pipe.poll(0) else None
    except (EOFError, OSError, ValueError):
        return None


def set_process_title(title: str) -> None:
    """Show ``title`` in ps and top, so an operator can tell raydp's processes apart."""
    # In a Ray worker, Ray's own copy of setproctitle owns the title's memory:
    # a second copy of the library would write where nobody reads.
    raylet = sys.modules.get("ray._raylet")
    if raylet is not None and hasattr(raylet, "setproctitle"):
        raylet.setproctitle(title)
        return
    import setproctitle

    setproctitle.setproctitle(title)


def keep_process_title(title: str) -> None:
    """Set ``title`` again if something else (Ray, after each actor call) replaced it."""
    try:
        with open("/proc/self/cmdline", "rb") as f:
            current = f.read()
    except OSError:
        return
    if not current.startswith(title.encode()):
        set_process_title(title)


def on_stop_signals(stop: Callable[[], None]) -> None:
    def handler(signum: int, frame: Any) -> None:
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
