"""Children forked from a preloading fork server: they start with its imports, but this process's environment.

Each check runs in a fresh interpreter: a process has one fork server, and
the first caller's preload is the one it keeps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from multiprocessing.connection import Connection
from pathlib import Path

import psutil
import pytest

from raydp.fork_server import child_context, gpu_driver_present

pytestmark = pytest.mark.timeout(120)

PROBE = textwrap.dedent(
    """
    import json, os, sys
    from multiprocessing import forkserver
    from multiprocessing.connection import Connection

    from raydp.fork_server import child_context
    from raydp.processes import shutdown, spawn
    from tests.unit.test_child_context import report


    def main() -> None:
        context = child_context(tuple(sys.argv[1:]))
        if context.get_start_method() == "forkserver":
            forkserver.ensure_running()  # started with this environment, before the variable below
        os.environ["RAYDP_PROBE_SET_AFTER"] = "parent's"  # after the fork server started, or before a spawn
        parent_end, child_end = context.Pipe(duplex=False)
        proc = spawn(context, "probe", report, child_end)
        child_end.close()
        seen = parent_end.recv()
        proc.process.join(30)
        shutdown([proc])
        after = child_context(tuple(sys.argv[1:])).get_start_method()  # for the next child
        method = context.get_start_method()
        print(json.dumps({"method": method, **seen, "exitcode": proc.process.exitcode, "after": after}))


    if __name__ == "__main__":
        main()
    """
)


def report(out: Connection, death_pipe: Connection) -> None:
    """In the child: what it found imported, and its environment."""
    import os

    out.send({"preloaded": "email.mime.text" in sys.modules, "env": os.environ.get("RAYDP_PROBE_SET_AFTER")})


def probe(*preload: str, path: str = "") -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH", "")]))}
    run = subprocess.run(
        [sys.executable, "-c", PROBE, *preload], capture_output=True, text=True, timeout=90, check=False, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result: dict[str, object] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


def test_without_a_preload_children_are_spawned() -> None:
    assert child_context().get_start_method() == "spawn"
    seen = probe()
    assert seen == {"method": "spawn", "preloaded": False, "env": "parent's", "exitcode": 0, "after": "spawn"}


def test_a_preloading_fork_server_hands_its_imports_and_this_process_environment_to_children() -> None:
    seen = probe("email.mime.text")  # a module nothing imports on its own
    forked = not gpu_driver_present()  # where a GPU driver is, children are spawned whatever the preload
    method = "forkserver" if forked else "spawn"
    assert seen == {"method": method, "preloaded": forked, "env": "parent's", "exitcode": 0, "after": method}


def test_a_fork_server_whose_preload_raises_is_given_up_and_the_child_is_spawned(tmp_path: Path) -> None:
    (tmp_path / "raydp_probe_broken.py").write_text("import email.mime.text\nraise RuntimeError('broken at import')\n")
    seen = probe("raydp_probe_broken", path=str(tmp_path))
    method = "spawn" if gpu_driver_present() else "forkserver"  # what was asked for the first child
    assert seen == {"method": method, "preloaded": False, "env": "parent's", "exitcode": 0, "after": "spawn"}


SIGNALLED = textwrap.dedent(
    """
    import json, os, signal, sys, time

    import psutil

    from raydp.fork_server import child_context
    from raydp.processes import shutdown, spawn
    from tests.unit.test_child_context import echo_mask, fork_servers, pending, status_mask


    context = child_context(("email.mime.text",))
    ours, theirs = context.Pipe()
    proc = spawn(context, "waiter", echo_mask, theirs)
    mask = ours.recv()
    [server] = fork_servers()
    blocked = status_mask(server.pid, "SigBlk")
    for signum in (signal.SIGHUP, signal.SIGTERM):  # as `kill -- -PGID` or a closed terminal would send them
        os.kill(server.pid, signum)
    deadline = time.monotonic() + 30
    while pending(server.pid) & 1 << (signal.SIGTERM - 1) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    held = pending(server.pid)
    ours.send("still there?")
    reply = ours.recv()
    running = server.is_running() and server.status() != psutil.STATUS_ZOMBIE
    seen = {"child_mask": mask, "server_blocked": blocked, "server_held": held, "reply": reply}
    print(json.dumps({**seen, "server_running": running, "alive": proc.process.is_alive()}))
    shutdown([proc])
    """
)


def fork_servers() -> list[psutil.Process]:
    """This process's fork servers (multiprocessing's forkserver processes among its children)."""
    return [p for p in psutil.Process().children() if "multiprocessing.forkserver" in " ".join(p.cmdline())]


def started_fork_servers(timeout_s: float = 30.0) -> list[psutil.Process]:
    """:func:`fork_servers` once there is one (or ``timeout_s`` has passed). A server just started has a pid
    at once but its command line only once its exec is done, and the kernel may run this process on before
    that: a loaded machine reads an empty one."""
    deadline = time.monotonic() + timeout_s
    while not (servers := fork_servers()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return servers


def echo_mask(pipe: Connection, death_pipe: Connection) -> None:
    """In the child: its blocked signals, then an answer to each message until the parent goes."""
    pipe.send(status_mask(os.getpid(), "SigBlk"))
    while True:
        pipe.send(f"yes: {pipe.recv()}")


def pending(pid: int) -> int:
    """The signals sent to process ``pid`` and not yet delivered (0 once it is gone)."""
    try:
        return status_mask(pid, "ShdPnd")
    except FileNotFoundError:
        return 0


def status_mask(pid: int, field: str) -> int:
    """A signal mask of ``/proc/PID/status`` (``SigBlk``, ``ShdPnd``, ...): bit ``n - 1`` for signal ``n``."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1], 16)
    raise LookupError(field)


@pytest.mark.skipif(gpu_driver_present(), reason="a GPU driver is present: children are spawned, no fork server")
def test_the_fork_server_outlives_a_sigterm_to_its_group_and_its_children_take_signals() -> None:
    run = subprocess.run([sys.executable, "-c", SIGNALLED], capture_output=True, text=True, timeout=90, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    both = 1 << (signal.SIGTERM - 1) | 1 << (signal.SIGHUP - 1)
    assert seen["server_blocked"] & both == both, "the server holds SIGTERM and SIGHUP, whatever their handlers"
    assert seen["server_held"] & 1 << (signal.SIGTERM - 1), "a SIGTERM reached the server, which did not act on it"
    assert seen["server_running"], "the server outlived both signals"
    assert seen["reply"] == "yes: still there?" and seen["alive"], "its child serves on, and is seen alive"
    assert seen["child_mask"] & both == 0, "the child takes SIGTERM and SIGHUP"


SERVER_KILLED = textwrap.dedent(
    """
    import json, queue, threading

    from raydp.fork_server import child_context
    from raydp.processes import shutdown, spawn, watch_processes
    from tests.unit.test_child_context import echo_mask, fork_servers


    context = child_context(("email.mime.text",))
    ours, theirs = context.Pipe()
    proc = spawn(context, "waiter", echo_mask, theirs)
    ours.recv()
    exits = queue.Queue()
    stop = threading.Event()
    watch_processes([proc], stop, lambda p: exits.put((p.exitcode, p.exit_text())), "probe-watcher")
    [server] = fork_servers()
    server.kill()  # alone, as the OOM killer would: its child runs on
    code, text = exits.get(timeout=30)
    try:  # read here, not through raydp: a zombie has ended, and a new start is another process
        fields = open(f"/proc/{proc.process.pid}/stat").read().rsplit(")", 1)[1].split()
        gone = fields[0] == "Z" or int(fields[19]) != proc.started
    except FileNotFoundError:
        gone = True
    ours, theirs = context.Pipe()
    successor = spawn(child_context(("email.mime.text",)), "successor", echo_mask, theirs)
    ours.recv()
    ours.send("and you?")
    after = {"successor_forked": successor.started is not None, "successor_reply": ours.recv()}
    stop.set()
    shutdown([proc, successor])
    print(json.dumps({"exitcode": code, "text": text, "gone": gone, **after}))
    """
)


@pytest.mark.skipif(gpu_driver_present(), reason="a GPU driver is present: children are spawned, no fork server")
def test_a_child_whose_fork_server_was_killed_is_killed_and_reported_so() -> None:
    run = subprocess.run([sys.executable, "-c", SERVER_KILLED], capture_output=True, text=True, timeout=90, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["gone"], "the child that looked exited is gone when its exit is reported: no orphan serves on"
    assert seen["exitcode"] == -signal.SIGKILL, "reported as killed, not as multiprocessing's 255"
    assert "its fork server died" in seen["text"], seen["text"]
    assert seen["successor_forked"], "the next child forks from a new server"
    assert seen["successor_reply"] == "yes: and you?", "and it runs"


EARLY = textwrap.dedent(
    """
    import json

    from raydp.fork_server import start_early
    from tests.unit.test_child_context import started_fork_servers

    nothing = start_early(())  # no preload: children are spawned, there is no server to start
    started = start_early(("email.mime.text",))
    servers = started_fork_servers()
    print(json.dumps({"nothing": nothing, "started": started, "servers": len(servers)}))
    """
)


@pytest.mark.skipif(gpu_driver_present(), reason="a GPU driver is present: children are spawned, no fork server")
def test_a_fork_server_started_early_runs_before_any_child() -> None:
    run = subprocess.run([sys.executable, "-c", EARLY], capture_output=True, text=True, timeout=90, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {"nothing": False, "started": True, "servers": 1}


GUARDED = textwrap.dedent(
    """
    import argparse, json, tempfile

    import psutil

    import raydp.models.vllm.config
    from raydp.cli.vllm_flags import VLLM_ENGINES, start_fork_server_early
    from tests.unit.test_child_context import started_fork_servers

    raydp.models.vllm.config.FORK_SERVER_PRELOAD = ("email.mime.text",)  # vLLM's import is not what is checked
    vllm, model = VLLM_ENGINES[0], tempfile.mkdtemp()
    refused = {
        "no model": (vllm, "mp", "internal", None),
        "no such directory": (vllm, "mp", "internal", model + "/missing"),
        "ranks and API servers on other machines": (vllm, "ray", "hybrid", model),
        "not vLLM": ("raydp.models.echo:EchoEngine", "mp", "internal", model),
    }
    started = {}
    for why, (engine, backend, lb_mode, path) in refused.items():
        start_fork_server_early(engine, argparse.Namespace(backend=backend, lb_mode=lb_mode, model=path))
        # Nothing at all: not even multiprocessing's resource tracker (a child the moment it is forked).
        started[why] = len(psutil.Process().children())
    start_fork_server_early(vllm, argparse.Namespace(backend="ray", lb_mode="internal", model=model))
    started["API servers forked here from a model directory"] = len(started_fork_servers())
    print(json.dumps(started))
    """
)


@pytest.mark.skipif(gpu_driver_present(), reason="a GPU driver is present: children are spawned, no fork server")
def test_serve_starts_its_fork_server_early_only_where_it_forks_vllm_from_a_model_directory() -> None:
    run = subprocess.run([sys.executable, "-c", GUARDED], capture_output=True, text=True, timeout=90, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == {
        "no model": 0,
        "no such directory": 0,
        "ranks and API servers on other machines": 0,
        "not vLLM": 0,
        "API servers forked here from a model directory": 1,
    }
