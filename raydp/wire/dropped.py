"""Logging what a socket drops: one line per message, naming its sender, at a bounded rate.

A component that drops a malformed message calls :meth:`DropLog.drop` once
for it, whatever its size or number of parts, with the sender as its socket
knows it: the identity a ROUTER prefixes (:func:`identity_sender`), the
peer address libzmq reports for a frame on a PULL or SUB (:func:`frame_sender`),
or else the socket's role.

Garbage is cheap to send, so the log is rate limited (``docs/architecture.md``,
"Failure handling"): each sender gets at most one line per ``interval_s``
(1 s), and all senders together at most ``burst`` lines per interval. What is
held back is counted, and the count rides on that sender's next line
(``... (41 more from this sender not logged)``); a sender that never drops
again keeps its count in :attr:`DropLog.dropped` only. At most
``max_senders`` senders are remembered, so rotating identities costs neither
memory nor log lines. Each reason is cut to ``MAX_REASON_CHARS``.

One instance belongs to one thread (each component drops on its IO thread).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import zmq

MAX_REASON_CHARS: Final = 300
MAX_IDENTITY_BYTES: Final = 16  # shown of a ROUTER identity (they run to 255 bytes)


def identity_sender(role: str, identity: bytes) -> str:
    """A ROUTER peer as ``role`` and its identity in hex (cut past ``MAX_IDENTITY_BYTES``)."""
    cut = "..." if len(identity) > MAX_IDENTITY_BYTES else ""
    return f"{role} {identity[:MAX_IDENTITY_BYTES].hex() or '(empty identity)'}{cut}"


def frame_sender(role: str, frame: zmq.Frame) -> str:
    """The peer of ``frame`` (received with ``copy=False``) as libzmq reports it, else ``role`` alone.

    TCP gives the peer's IP; IPC gives ``localhost:uid:gid:pid`` where the
    kernel tells; inproc gives nothing.
    """
    try:
        address = frame.get("Peer-Address")
    except zmq.ZMQError:
        return role
    return f"{role} peer {address}" if address else role


@dataclass
class _Sender:
    last_logged: float
    held_back: int = 0


class DropLog:
    """Counts every dropped message; logs them as the module docstring says."""

    def __init__(
        self,
        logger: logging.Logger,
        component: str,
        *,
        what: str = "malformed message",
        interval_s: float = 1.0,
        burst: int = 20,
        max_senders: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger, self._component, self._what = logger, component, what
        self._interval, self._burst, self._max_senders, self._clock = interval_s, burst, max_senders, clock
        self._senders: dict[str, _Sender] = {}
        self._window_start = -float("inf")
        self._window_lines = 0
        self._held_back_elsewhere = 0  # over the burst, or from senders forgotten meanwhile
        self.dropped = 0

    def drop(self, sender: str, why: str) -> None:
        """Count one dropped message from ``sender``; log it unless the rate limits hold it back."""
        self.dropped += 1
        now = self._clock()
        known = self._senders.get(sender)
        if known is not None and now - known.last_logged < self._interval:
            known.held_back += 1
            return
        if now - self._window_start >= self._interval:
            self._window_start, self._window_lines = now, 0
        if self._window_lines >= self._burst:
            self._held_back_elsewhere += 1
            return
        self._window_lines += 1
        self._log(sender, why, known.held_back if known is not None else 0)
        self._remember(sender, now)

    def _log(self, sender: str, why: str, held_back: int) -> None:
        if len(why) > MAX_REASON_CHARS:
            why = why[:MAX_REASON_CHARS] + "..."
        notes = []
        if held_back:
            notes.append(f"{held_back} more from this sender not logged")
        if self._held_back_elsewhere:
            notes.append(f"{self._held_back_elsewhere} more from other senders not logged")
            self._held_back_elsewhere = 0
        suffix = f" ({'; '.join(notes)})" if notes else ""
        self._logger.warning("%s: dropped a %s from %s: %s%s", self._component, self._what, sender, why, suffix)

    def _remember(self, sender: str, now: float) -> None:
        self._senders.pop(sender, None)
        self._senders[sender] = _Sender(now)  # last in the dict: the table is oldest-logged first
        while len(self._senders) > self._max_senders:
            oldest = next(iter(self._senders))
            self._held_back_elsewhere += self._senders.pop(oldest).held_back
