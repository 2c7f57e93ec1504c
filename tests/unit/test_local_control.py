"""The ``mp`` backend's control pipe over a real socketpair: a late answer fails one question, not the pipe."""

from __future__ import annotations

import multiprocessing as mp
import threading
from typing import Any

import pytest

from raydp.errors import StartupError
from raydp.local.control import ControlPipe, answer_commands
from tests.unit.wire_targets import wait_until

pytestmark = pytest.mark.timeout(30)


class SlowFirstState:
    """The coordinator loop's side of ``state``: the first answer waits until the test lets it go."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def describe(self) -> dict[str, Any]:
        self.calls += 1
        if self.calls == 1:
            assert self.release.wait(20)
        return {"call": self.calls}


def test_an_answer_that_comes_too_late_is_dropped_and_the_next_question_gets_its_own() -> None:
    ours, theirs = mp.Pipe()
    loop = SlowFirstState()
    alive = threading.Event()
    running = threading.Thread(target=alive.wait, daemon=True)  # stands for the coordinator's loop thread
    running.start()
    answering = threading.Thread(target=answer_commands, args=(loop, theirs, running), daemon=True)
    answering.start()
    pipe = ControlPipe(ours)
    with pytest.raises(StartupError, match=r"did not answer 'state' within 0.2s"):
        pipe.ask("state", timeout_s=0.2)
    loop.release.set()  # the first answer now comes, after its asker gave up
    assert pipe.ask("state", timeout_s=10) == {"call": 2}, "the second question's own answer, not the first's"
    assert pipe.ask("state", timeout_s=10) == {"call": 3}
    pipe.stop()  # tells the other end to stop
    answering.join(10)
    assert not answering.is_alive()
    alive.set()
    pipe.close()
    with pytest.raises(StartupError, match="closed"):
        pipe.ask("state", timeout_s=1)


def test_a_stop_does_not_wait_behind_a_question_in_flight() -> None:
    """close() must not wait behind a long question (a restart waiting for its rank to subscribe)."""
    ours, theirs = mp.Pipe()
    loop = SlowFirstState()
    running = threading.Thread(target=threading.Event().wait, daemon=True)
    running.start()
    threading.Thread(target=answer_commands, args=(loop, theirs, running), daemon=True).start()
    pipe = ControlPipe(ours)
    asking = threading.Thread(target=pipe.ask, args=("state",), kwargs={"timeout_s": 20}, daemon=True)
    asking.start()
    assert wait_until(lambda: loop.calls == 1), "the question reached the coordinator, which holds its answer"
    stopping = threading.Thread(target=pipe.stop, daemon=True)
    stopping.start()
    stopping.join(10)
    assert not stopping.is_alive() and asking.is_alive(), "the stop went out while the question still waited"
    assert theirs.poll(10), "the coordinator's end has the stop to read"
    loop.release.set()
    asking.join(20)
    pipe.close()


def test_a_gone_coordinator_is_a_typed_error() -> None:
    ours, theirs = mp.Pipe()
    theirs.close()
    with pytest.raises(StartupError, match="gone"):
        ControlPipe(ours).ask("state", timeout_s=5)
