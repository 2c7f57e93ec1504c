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
