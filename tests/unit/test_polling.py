"""One poll() over ZMQ sockets' FDs and doorbells (raydp.wire.polling), on real sockets and pipes."""

from __future__ import annotations

import os
import threading

import pytest
import zmq

from raydp.wire.polling import Doorbell, EdgePoller, has_input

pytestmark = pytest.mark.timeout(30)


def test_a_ring_ends_a_wait_and_is_drained_there() -> None:
    bell = Doorbell()
    poller = EdgePoller([], [bell])
    try:
        threading.Timer(0.05, bell.ring).start()
        assert poller.wait(10_000) == []  # woken by the ring, long before its timeout
        assert poller.wait(0) == []  # drained: it does not wake the next wait
    finally:
        bell.close()


def test_a_late_ring_of_a_closed_doorbell_writes_to_nobody() -> None:
    """A thread may ring a doorbell just as its owner closes it; the descriptor number may
    already belong to a new pipe by then."""
    bell = Doorbell()
    bell.close()
    read, write = os.pipe()  # likely given the numbers the doorbell just freed
    try:
        os.set_blocking(read, False)
        bell.ring()
        with pytest.raises(BlockingIOError):
            os.read(read, 1)
    finally:
        os.close(read)
        os.close(write)


def test_a_socket_checked_once_signals_each_later_message() -> None:
    """The FD fires for input that arrives after a read found nothing; not for input that was
    there before anyone checked."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.bind("inproc://polling")
        push.connect("inproc://polling")
        poller = EdgePoller([pull])
        assert not has_input(pull)  # the check before the first wait
        push.send(b"one")
        assert poller.wait(5_000) == [pull]
        assert pull.recv(zmq.NOBLOCK) == b"one"
        assert not has_input(pull)
        push.send(b"two")
        assert poller.wait(5_000) == [pull]
        assert pull.recv(zmq.NOBLOCK) == b"two"
    finally:
        ctx.destroy(linger=0)
