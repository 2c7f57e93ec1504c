"""A cluster handle's finalizer closes its clients from a thread that can: not the client's own IO thread."""

from __future__ import annotations

import threading

import pytest

from raydp.handle_refs import close_all


@pytest.mark.timeout(30)
def test_a_handle_collected_in_a_clients_io_thread_closes_the_client_from_another_thread() -> None:
    closed = threading.Event()
    errors: list[BaseException] = []

    def close() -> None:  # as a client's close does: it joins the client's IO thread
        try:
            io.join(timeout=10)
            closed.set()
        except RuntimeError as exc:  # "cannot join current thread"
            errors.append(exc)

    # The collector may run the handle's finalizer in any thread; here, the IO thread itself.
    io = threading.Thread(target=lambda: close_all([close]), name="raydp-client-io")
    io.start()
    assert closed.wait(20), "the client was closed"
    assert errors == []


@pytest.mark.timeout(30)
def test_a_backend_collected_on_a_thread_that_holds_its_lock_is_released_once_the_lock_is_free() -> None:
    """A restart tells the listeners under the launch's lock; if the last handle goes in that call, the
    backend's finalizer runs right there, and a release in place would wait on that lock forever."""
    from raydp.orchestration.owned import OwnedResources

    stopped = threading.Event()

    class Recorded(OwnedResources):
        def stop_components(self) -> None:
            stopped.set()

    owned = Recorded(name="x")
    while_held: list[bool] = []

    def restart_telling_the_listeners() -> None:
        with owned.lock:
            owned.collected()  # the finalizer, run by a collection on this very thread
            while_held.append(stopped.is_set())

    worker = threading.Thread(target=restart_telling_the_listeners, daemon=True)
    worker.start()
    worker.join(10)
    assert not worker.is_alive(), "the finalizer did not wait on the lock its own thread holds"
    assert while_held == [False], "nothing was released under the lock"
    assert stopped.wait(10) and owned.released
