"""Socket directories of processes that died without cleaning up are swept; live owners' never are."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest

from raydp.wire.transport import IpcDir, sweep_stale_ipc_dirs


def _make_dir_then_wait(prefix: str, conn: object) -> None:
    d = IpcDir(prefix)
    conn.send(str(d.path))  # type: ignore[attr-defined]
    signal.pause()


@pytest.mark.timeout(60)
def test_a_killed_owners_directory_is_swept_and_a_live_ones_kept() -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_make_dir_then_wait, args=("test-sweep-dead", child), daemon=True)
    proc.start()
    try:
        assert parent.poll(30)
        dead_dir = parent.recv()
        mine = IpcDir("test-sweep-live")
        assert os.path.isdir(dead_dir)
        assert dead_dir not in map(str, sweep_stale_ipc_dirs()), "its owner still runs"
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        assert dead_dir in map(str, sweep_stale_ipc_dirs())
        assert not os.path.exists(dead_dir)
        assert mine.path.is_dir(), "a live process's directory stays"
        reused = IpcDir.reuse(mine.address("x"))  # a successor claims its dead predecessor's directory
        assert reused.path == mine.path
        mine.remove()
    finally:
        if proc.is_alive():
            proc.kill()


@pytest.mark.timeout(30)
def test_a_directory_claimed_in_another_pid_namespace_is_never_judged() -> None:
    from raydp.wire.transport import _pid_namespace

    root = IpcDir.root()
    root.mkdir(mode=0o700, exist_ok=True)
    other = root / "test-sweep-other-ns"
    dead_here = root / "test-sweep-dead-here"
    for path, ns in ((other, "pid:[1]" if _pid_namespace() != "pid:[1]" else "pid:[2]"), (dead_here, _pid_namespace())):
        path.mkdir(mode=0o700, exist_ok=True)
        (path / ".owner").write_text(f"{2**22 + 17} 1.000 {ns}")  # a pid no process here has
    try:
        swept = sweep_stale_ipc_dirs()
        assert other.is_dir() and other not in swept, "another container's process may well be alive"
        assert dead_here in swept and not dead_here.exists()
    finally:
        for path in (other, dead_here):
            if path.exists():
                import shutil

                shutil.rmtree(path)
