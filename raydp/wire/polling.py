"""Waiting on several ZMQ sockets with one ``poll()`` call: their ``ZMQ_FD``s, and doorbells.

``zmq_poll`` asks every socket for ``ZMQ_EVENTS`` before it blocks and again
after, and each ask is a system call or two (a ``poll`` of the socket's
mailbox, and libzmq's fork check). On a VM, where system calls are dear, an
engine waiting on four sockets spent more in that wait than in its work.

A socket's ``ZMQ_FD`` is edge-triggered: it becomes readable when commands
reach the socket, and a message signals only a socket whose last read found
nothing; any operation on the socket (a send included) may consume a signal
while input waits unread. So whoever waits with an :class:`EdgePoller`:

* checks every socket once (:func:`has_input`) before its first wait;
* reads a socket until it has nothing left once its FD fires, or remembers
  that it stopped early and comes back without waiting;
* checks a socket it sent on before blocking on its FD again.
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Sequence

import zmq

_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


def has_input(sock: zmq.Socket[bytes]) -> bool:
    """Whether a message waits (processing the socket's commands, so its FD signals the next)."""
    return bool(int(sock.getsockopt(_EVENTS)) & _POLLIN)


class Doorbell:
    """A pipe polled next to the sockets, so other threads can wake the one that waits.

    A pipe rather than an inproc ZMQ pair: a write and a wake-up from ``poll``
    cost a few microseconds, where a ZMQ send and the receiver's mailbox round
    trip cost tens. Ringing a closed doorbell does nothing: ring and close
    exclude each other, so a late ring never writes to a reused descriptor.
    """

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._lock = threading.Lock()
        self._closed = False

    @property
    def fileno(self) -> int:
        return self._read

    def ring(self) -> None:
        with self._lock:
            if self._closed:
                return  # nobody to wake
            try:
                os.write(self._write, b"!")
            except BlockingIOError:
                pass  # full: the waiter has rings to read already

    def drain(self) -> None:
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                os.close(self._read)
                os.close(self._write)


class EdgePoller:
    """One ``poll()`` over ``sockets``' ``ZMQ_FD``s and ``bells``; see the module docstring."""

    def __init__(self, sockets: Sequence[zmq.Socket[bytes]], bells: Sequence[Doorbell] = ()) -> None:
        self._poll = select.poll()
        self._sockets: dict[int, zmq.Socket[bytes]] = {}
        self._bells: dict[int, Doorbell] = {}
        for sock in sockets:
            fd = int(sock.getsockopt(zmq.FD))
            self._sockets[fd] = sock
            self._poll.register(fd, select.POLLIN)
        for bell in bells:
            self._bells[bell.fileno] = bell
            self._poll.register(bell.fileno, select.POLLIN)

    def wait(self, timeout_ms: int) -> list[zmq.Socket[bytes]]:
        """Block up to ``timeout_ms`` (-1: no limit) for a signal; the sockets whose FD fired.

        A ringing doorbell ends the wait and is drained here. A socket may come
        back with no input, or closed meanwhile: the caller checks.
        """
        fired = []
        for fd, _ in self._poll.poll(timeout_ms):
            sock = self._sockets.get(fd)
            if sock is not None:
                fired.append(sock)
            elif (bell := self._bells.get(fd)) is not None:
                bell.drain()
        return fired
