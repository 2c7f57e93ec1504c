"""The ``mp`` backend's control pipe to its coordinator process: numbered questions and their answers.

The launcher asks (:class:`ControlPipe`); the coordinator process answers
(:func:`answer_commands`). Messages are msgpack lists, never pickle:
``[number, command, *args]`` one way and ``[number, answer]`` the other;
number 0 is ``shutdown``, which has no answer. Every answer repeats its
question's number, so one that comes after its asker gave up (a coordinator
busy past the limit) is recognised and dropped at the next question, not
read as that question's answer: a slow answer fails one call, not every
call after it. Commands: ``wait_for_engines``, ``wait_for_rank``, ``state``,
``shutdown``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from raydp.errors import StartupError

logger = logging.getLogger("raydp.local")
SHUTDOWN = 0  # the number of the one message that has no answer


def send(conn: Connection, value: Any) -> None:
    """Control messages are msgpack too: no pickle crosses this socketpair either."""
    conn.send_bytes(msgspec.msgpack.encode(value))


def recv(conn: Connection, kind: Any) -> Any:
    return msgspec.msgpack.decode(conn.recv_bytes(), type=kind)


class ControlPipe:
    """The launcher's end: one question at a time, each answered or given up on after ``timeout_s``."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.closed = False
        self._lock = threading.Lock()  # one question and its answer at a time
        self._sending = threading.Lock()  # a stop may be sent while a question waits for its answer
        self._asked = 0

    def ask(self, *command: Any, timeout_s: float) -> Any:
        """The coordinator's answer to ``command``; :class:`~raydp.errors.StartupError` if none comes in time."""
        with self._lock:
            if self.closed:
                raise StartupError("the coordinator process stopped answering: its control pipe is closed")
            self._asked += 1
            number = self._asked
            try:
                with self._sending:
                    send(self.conn, [number, *command])
                deadline = time.monotonic() + timeout_s
                while self.conn.poll(max(0.0, deadline - time.monotonic())):
                    answered, answer = recv(self.conn, tuple[int, Any])
                    if answered == number:
                        return answer
                    logger.info("coordinator control pipe: dropped the late answer to question %d", answered)
            except (EOFError, OSError) as exc:
                raise StartupError(f"the coordinator process is gone ({command[0]!r} unanswered): {exc!r}") from exc
            raise StartupError(f"the coordinator process did not answer {command[0]!r} within {timeout_s:g}s")

    def stop(self) -> None:
        """Tell the coordinator to stop, at once: a question in flight then ends with its process."""
        self.closed = True
        with self._sending, contextlib.suppress(OSError, ValueError):
            send(self.conn, [SHUTDOWN, "shutdown"])

    def close(self) -> None:
        """Close this end (after :meth:`stop`, once the coordinator process has ended)."""
        self.closed = True
        with self._sending:
            self.conn.close()


def answer_commands(loop: Any, conn: Connection, thread: threading.Thread) -> None:
    """The coordinator process's end: answer each question while ``thread`` (its loop) runs."""
    while thread.is_alive():
        if not conn.poll(0.1):
            continue
        try:
            number, command, *args = recv(conn, list[Any])
        except EOFError:
            return
        if command == "shutdown":
            return  # the caller's loop.close() stops the loop and waits for its teardown
        if command == "wait_for_engines":
            answer = loop.wait_for_engines(*args)
        elif command == "wait_for_rank":
            answer = loop.wait_for_rank(*args)
        elif command == "state":
            answer = loop.describe()
        else:
            logger.warning("coordinator control pipe: dropped unknown command %r", command)
            continue
        send(conn, [number, answer])
