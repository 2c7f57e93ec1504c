"""The ``mp`` backend's child processes: an engine rank, and the coordinator driven over a control pipe.

Each child is spawned with a death pipe (:func:`raydp.processes.spawn`): it
ends when the parent goes, and leaves its last words there (why it failed,
as msgpack) before it exits. The coordinator answers numbered commands on a
msgpack control pipe (:mod:`raydp.local.control`): no pickle crosses either pipe.
"""

from __future__ import annotations

import os
import threading
from multiprocessing.connection import Connection

import msgspec

from raydp.config import RaydpConfig
from raydp.errors import ComponentDeadError, DeathCause, EngineHungError
from raydp.local.control import answer_commands, send
from raydp.processes import leave_last_words, on_stop_signals, set_process_title, watch_parent
from raydp.wire.transport import socket_options

LOCAL_NODE = "local"
HUNG_EXIT_CODE = 70  # EX_SOFTWARE; the death pipe carries the reason


def engine_main(config: RaydpConfig, rank: int, addresses: list[str], prefix: str, death_pipe: Connection) -> None:
    from raydp.engine.host import EngineHost
    from raydp.local.executor import MPExecutor, rank_device_ids

    said: list[bool] = []

    def last_words(exc: BaseException) -> None:
        if not said:
            said.append(True)
            leave_last_words(death_pipe, encode_death(exc))

    try:
        devices = rank_device_ids(config, rank)
        host = EngineHost(
            config, rank, rank, LOCAL_NODE, LOCAL_NODE, devices, ipc_prefix=prefix, executor_factory=MPExecutor
        )
        host.on_failure = last_words
        set_process_title(f"raydp::{host.tag}")
        on_stop_signals(host.shutdown)
        watch_parent(death_pipe, host.shutdown)
        host.run(addresses)
    except EngineHungError as exc:
        last_words(exc)
        os._exit(HUNG_EXIT_CODE)  # the stuck loop thread would hold the interpreter's teardown
    except BaseException as exc:
        last_words(exc)
        raise


class LastWords(msgspec.Struct, frozen=True):
    """Why an engine process failed, sent to the parent before it exits."""

    cause: str
    message: str


def encode_death(exc: BaseException) -> bytes:
    cause = exc.cause.value if isinstance(exc, ComponentDeadError) else DeathCause.ENGINE_ERROR.value
    message = exc.detail if isinstance(exc, EngineHungError) else f"{type(exc).__name__}: {exc}"
    return msgspec.msgpack.encode(LastWords(cause, message))


def decode_death(words: bytes | None) -> LastWords | None:
    try:
        return msgspec.msgpack.decode(words, type=LastWords) if words else None
    except (msgspec.DecodeError, ValueError):
        return None


def coordinator_main(config: RaydpConfig, prefix: str, conn: Connection, death_pipe: Connection) -> None:
    from raydp.coordinator.loop import CoordinatorLoop
    from raydp.coordinator.state import CoordinatorState
    from raydp.logs import configure_component_logging

    configure_component_logging(f"{config.name} coordinator")
    state = CoordinatorState(config.dp_size, config.stats_interval_s, config.heartbeat_interval_s)
    loop = CoordinatorLoop(
        state, socket_options(config), transport="ipc", node_id=LOCAL_NODE, ipc_prefix=f"{prefix}-coordinator"
    )
    on_stop_signals(loop.stop)
    watch_parent(death_pipe, loop.stop)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    send(conn, loop.endpoints)
    answer_commands(loop, conn, thread)
    loop.close()
