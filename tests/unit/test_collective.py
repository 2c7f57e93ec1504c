"""The lockstep DP group over real processes and a real TCP rendezvous."""

from __future__ import annotations

import errno
import multiprocessing
import socket
from typing import Any

import pytest

from raydp.engine.collective import GlooDPGroup, Rendezvous

pytestmark = pytest.mark.timeout(120)  # a failure path waits up to 60 s, then joins


ROUNDS = [[False, True, False], [False, False, False], [True, False, False]]  # per round, each rank's flag
# Per round, each rank's (unfinished, held): the two flags are reduced independently.
HOLD_ROUNDS = [
    [(False, False), (False, True), (False, False)],  # one rank held, nobody has work
    [(True, False), (False, False), (False, False)],  # work, nobody held
    [(False, False), (False, False), (False, False)],
    [(True, True), (False, False), (False, True)],
]


def _rank_main(master: str, rank: int, size: int, results: Any) -> None:
    group = GlooDPGroup(master, rank, size, timeout_s=60)
    try:
        unfinished = [group.sync(flags[rank], False)[0] for flags in ROUNDS]
        synced = [group.sync(*flags[rank]) for flags in HOLD_ROUNDS]
        # Non-blocking, with blocking all-reduces in between (as the engine's own collective runs).
        collected, paces = [], []
        for n, flags in enumerate(HOLD_ROUNDS):
            group.start(*flags[rank], pace=100 * n + rank)  # each rank's own pace: all learn the MAX
            group.sync(False, False)
            collected.append(group.collect())
            paces.append(group.last_pace)
        results.put((rank, (unfinished, synced, collected, paces)))
    finally:
        group.close()


def test_the_rendezvous_port_is_taken_from_the_moment_it_is_announced() -> None:
    """The address handed to the ranks cannot be grabbed by anyone else meanwhile (the old EADDRINUSE race)."""
    rendezvous = Rendezvous("127.0.0.1", 2, timeout_s=30)
    try:
        host, _, port = rendezvous.address.rpartition(":")
        with socket.socket() as other, pytest.raises(OSError) as caught:
            other.bind((host, int(port)))
        assert caught.value.errno == errno.EADDRINUSE
    finally:
        rendezvous.close()


def test_the_rendezvous_listens_on_the_given_interface_only() -> None:
    import psutil

    rendezvous = Rendezvous("127.0.0.1", 2, timeout_s=30)
    try:
        port = int(rendezvous.address.rpartition(":")[2])
        listening = [
            c.laddr.ip
            for c in psutil.net_connections("tcp")
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
        ]
        assert listening == ["127.0.0.1"], listening
    finally:
        rendezvous.close()


def test_ranks_meet_at_a_hosted_rendezvous_and_agree_on_unfinished_work_and_hold() -> None:
    spawn = multiprocessing.get_context("spawn")
    results = spawn.Queue()
    rendezvous = Rendezvous("127.0.0.1", 3, timeout_s=60)
    procs = [spawn.Process(target=_rank_main, args=(rendezvous.address, rank, 3, results)) for rank in range(3)]
    for proc in procs:
        proc.start()
    try:
        answers = dict(results.get(timeout=60) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        rendezvous.close()
    # Any rank with work makes every rank hear "unfinished"; nobody with work, nobody hears it.
    assert {rank: a[0] for rank, a in answers.items()} == {rank: [True, False, True] for rank in range(3)}
    # Likewise "held": one held rank makes every rank see hold=True, independently of the work flag.
    expected = [(False, True), (True, False), (False, False), (True, True)]
    assert {rank: a[1] for rank, a in answers.items()} == {rank: expected for rank in range(3)}
    assert {rank: a[2] for rank, a in answers.items()} == {rank: expected for rank in range(3)}, "start + collect"
    assert {rank: a[3] for rank, a in answers.items()} == {rank: [2, 102, 202, 302] for rank in range(3)}, "paces"
    assert [p.exitcode for p in procs] == [0, 0, 0]
