"""The per-rank busy loop: poll inputs, add/abort, step, send outputs, publish load.

:class:`EngineLoop` owns one rank's sockets once the handshake is done
(:class:`~raydp.engine.sockets.EngineSockets`: the client inputs, the coordinator's
collect and broadcast sockets, a doorbell).

The loop answers two utilities itself, before the user's engine sees them:
``raydp_counters`` returns ``{"added", "finished", "aborted"}``, the requests
this rank accepted, finished (including errors) and dropped on an abort or a
lost client, so tests and operators can check what happened to requests
without asking the engine; ``raydp_workers`` describes the rank's device
workers (TP rank, node, pid, devices), or ``[]`` when it has none.

The load (``EngineStats``) goes to the coordinator when it changes, and at
least every :data:`ALIVE_EVERY_S` unchanged: the coordinator's sign that the
rank's process still runs (:mod:`raydp.coordinator.silence`).

Malformed messages are logged and dropped. A request the user's engine rejects
fails alone with an error output; an exception from ``step()`` fails every
in-flight request with it and then propagates, so the rank is reported dead.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from typing import Any

import msgspec
import zmq

from raydp.engine.adapter_report import AdapterReporter
from raydp.engine.cache_report import CacheReporter
from raydp.engine.core import EngineCore
from raydp.engine.executor import WORKER_DESCRIBE, Executor
from raydp.engine.lockstep import LockstepRank
from raydp.engine.outbox import Outbox
from raydp.engine.sockets import EngineSockets
from raydp.engine.watchdog import TurnClock
from raydp.errors import ProtocolError
from raydp.wire.codec import encode
from raydp.wire.control import EngineReport, EngineStats, Resync, SendCache, Shutdown, engine_broadcast_decoder
from raydp.wire.dropped import DropLog, identity_sender
from raydp.wire.protocol import (
    COORDINATOR_UTILITY,
    Abort,
    Output,
    OutputBatch,
    Request,
    RequestBatch,
    UtilityCall,
    UtilityResult,
    decode_input,
)

logger = logging.getLogger("raydp.engine.core")
IDLE_POLL_MS = 1000
# A rank whose loop turns says something to the coordinator at least this often, its load unchanged or
# not: a rank silent for long is frozen whole (raydp.coordinator.silence), past what its watchdog sees.
ALIVE_EVERY_S = 1.0
INPUT_BUDGET = 512  # messages taken per socket between two steps
BUILTIN_COUNTERS = "raydp_counters"  # utilities the loop answers itself
BUILTIN_WORKERS = "raydp_workers"
COUNTERS = ("added", "finished", "aborted")  # what it counts, per rank
# The engine core's own methods: the loop drives these, a utility call may not.
ENGINE_PROTOCOL = frozenset(
    {
        "add_request",
        "abort",
        "step",
        "has_unfinished",
        "load",
        "execute_dummy_batch",
        "shutdown",
        "attach_dp_group",
        "cache_events",
    }
)


class EngineLoop:
    """Drives one user engine core; see the module docstring for the protocol."""

    def __init__(
        self,
        engine: EngineCore,
        rank: int,
        sockets: EngineSockets,
        *,
        lockstep: LockstepRank | None = None,
        stats_interval_s: float = 0.1,
        workers: Executor | None = None,
    ) -> None:
        self.engine, self.rank, self.sockets = engine, rank, sockets
        self.workers = workers
        self.lockstep = lockstep
        self._stats_gap, self._work_gap = stats_interval_s / 4, stats_interval_s
        self._reports_work = callable(getattr(engine, "work", None))
        self._owners: dict[str, tuple[bytes, int]] = {}  # request id -> (client, seq)
        self._last_load: tuple[int, int, int] = (-1, -1, -1)
        self._last_load_sent = 0.0
        self._stopping = False
        self._failure: BaseException | None = None
        self._outbox = Outbox(sockets, self._forget_client)
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._drops = DropLog(logger, f"rank {rank}")
        self._cache = CacheReporter(engine, rank, self._to_coordinator, stats_interval_s)
        self._adapters = AdapterReporter(engine, rank, self._to_coordinator, stats_interval_s)
        self.clock = TurnClock()  # read by the host's watchdog from another thread
        self.clock.peers = lockstep

    # ---- the loop ---------------------------------------------------------------

    def run(self) -> None:
        """Loop until a Shutdown broadcast or :meth:`stop`; re-raises engine failures."""
        try:
            self._publish_load(force=True)  # at once, not after the first (possibly idle) poll
            has_work, stepping = self._recheck()
            clock = self.clock
            while not self._stopping:
                clock.turn_started = time.monotonic()
                if self._failure is not None:
                    raise self._failure
                if self.sockets.apply_move():  # the coordinator moved: tell the new one the load at once
                    self._last_load = (-1, -1, -1)
                    self._publish_load(force=True)
                    self._cache.send_full()
                    self._adapters.send_again(time.monotonic())
                if self._outbox.behind:
                    self._outbox.flush()
                took = self._poll_inputs(block=not self._outbox.behind and not stepping)
                if self._failure is not None:
                    raise self._failure
                if self._stopping:
                    break
                # A busy turn that took no input needs no new look: only inputs change
                # the engine's requests or the wave between two steps, and the look
                # is a good share of a near-empty step's cost.
                if took or not stepping:
                    has_work, stepping = self._recheck()
                if not stepping:
                    self._publish_load(force=True)
                    continue
                left = self._step_once(has_work)
                # The step that finishes the last request is published at once too: the
                # next turn may block in poll for a second, with the load shown stale.
                self._publish_load(force=has_work and not left)
                has_work, stepping = left, self._should_step(left)
        except BaseException as exc:
            self._fail_all(f"engine rank {self.rank} failed: {exc!r}")
            raise

    def stop(self) -> None:
        """Ask the loop to leave at its next turn (the host rings the wake socket too)."""
        self._stopping = True

    def fail(self, exc: BaseException) -> None:
        """From another thread: fail every in-flight request with ``exc`` and raise it (e.g. a worker died)."""
        self._failure = exc

    def _recheck(self) -> tuple[bool, bool]:
        """``(has_work, stepping)``: whether the engine has unfinished requests, whether to step."""
        if self.lockstep is not None:
            self.lockstep.tick()
        has_work = self.engine.has_unfinished()
        return has_work, self._should_step(has_work)

    def _should_step(self, has_work: bool) -> bool:
        return self.lockstep.should_step(has_work) if self.lockstep else has_work

    def _poll_inputs(self, block: bool) -> bool:
        """Take what has arrived, at most a budget per socket, so steps are never starved;
        whether any message came."""
        ready = self.sockets.wait(IDLE_POLL_MS if block else 0)
        if self._stopping or self._failure is not None:
            return False  # woken by stop() or fail(): the caller acts on it
        took = False
        for sock in ready:
            on_frames = self._on_broadcast if sock is self.sockets.broadcast else self._on_input
            for frames in self.sockets.drain(sock, INPUT_BUDGET):
                took = True
                on_frames(frames)
        return took

    def _step_once(self, has_work: bool) -> bool:
        """One step (a dummy one for an idle lockstep rank); whether work is left after it."""
        if has_work:
            self._send_outputs(self.engine.step())
        else:
            self.engine.execute_dummy_batch()
        self.clock.steps += 1
        left = self.engine.has_unfinished()
        if self.lockstep is not None:
            self.lockstep.after_step(left)
        return left

    # ---- inputs ----------------------------------------------------------------

    def _on_input(self, frames: list[bytes]) -> None:
        if len(frames) != 3:  # a ROUTER puts the identity first: frames[0] is always there
            return self._drop(identity_sender("client", frames[0]), f"input with {len(frames)} frames (want 3)")
        client, tag, body = frames
        try:
            msg = decode_input(tag, body)
        except ProtocolError as exc:
            return self._drop(identity_sender("client", client), str(exc))
        if isinstance(msg, Request):
            self._add(client, msg)
        elif isinstance(msg, RequestBatch):
            for request in msg.requests:
                self._add(client, request)
        elif isinstance(msg, Abort):
            self._abort(client, msg)
        else:
            self._utility(client, msg)
        return None

    def _add(self, client: bytes, request: Request) -> None:
        rid, seq = request.request_id, request.seq
        if rid in self._owners:
            self._send(client, [Output(rid, [], True, "error", f"duplicate request id {rid!r}", seq)])
            return
        if self.lockstep is not None:
            self.lockstep.on_request(request.wave)
        try:
            self.engine.add_request(request)
        except Exception as exc:  # the user's engine refused this one request
            self._send(client, [Output(rid, [], True, "error", f"rejected by engine: {exc!r}", seq)])
            return
        self._owners[rid] = (client, seq)
        self.counters["added"] += 1

    def _abort(self, client: bytes, msg: Abort) -> None:
        # Only the owner may abort: another client reusing the id must not. An id named twice is aborted once.
        self._abort_ids([rid for rid in dict.fromkeys(msg.request_ids) if self._owner(rid) == client])

    def _owner(self, rid: str) -> bytes | None:
        owner = self._owners.get(rid)
        return owner[0] if owner is not None else None

    def _abort_ids(self, ids: list[str]) -> None:
        if ids:
            self.engine.abort(ids)
            for rid in ids:
                del self._owners[rid]
            self.counters["aborted"] += len(ids)

    def _utility(self, client: bytes, call: UtilityCall) -> None:
        try:
            if call.method == BUILTIN_COUNTERS:
                value: Any = self._counters(*call.args)
            elif call.method == COORDINATOR_UTILITY:
                moved = self.sockets.coordinator
                value = msgspec.to_builtins(moved) if moved is not None else None
            elif call.method == BUILTIN_WORKERS:
                value = self.workers.collective_rpc(WORKER_DESCRIBE) if self.workers is not None else []
            elif call.method.startswith("_") or call.method in ENGINE_PROTOCOL:
                raise AttributeError(f"{call.method!r} is not a utility method")
            else:
                value = getattr(self.engine, call.method)(*call.args)
            body = encode(OutputBatch(self.rank, [], UtilityResult(call.call_id, value)))
        except Exception as exc:  # a bad call fails alone, never the rank
            error = UtilityResult(call.call_id, None, f"{type(exc).__name__}: {exc}")
            body = encode(OutputBatch(self.rank, [], error))
        self._outbox.send(client, body)

    def _counters(self) -> dict[str, int]:
        return dict(self.counters)

    def _on_broadcast(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            return self._drop("coordinator broadcast", f"broadcast with {len(frames)} frames (want 2)")
        try:
            msg = engine_broadcast_decoder(frames[1])
        except ProtocolError as exc:
            return self._drop("coordinator broadcast", str(exc))
        if isinstance(msg, Shutdown):
            self._stopping = True
        elif isinstance(msg, Resync):
            self._report_state()
        elif isinstance(msg, SendCache):
            self._cache.send_full()
        elif self.lockstep is not None:
            self.lockstep.on_broadcast(msg)
        return None

    # ---- outputs ---------------------------------------------------------------

    def _send_outputs(self, outputs: list[Output]) -> None:
        by_client: dict[bytes, list[Output]] = defaultdict(list)
        for out in outputs:
            owner = self._owners.get(out.request_id)
            if owner is None:
                continue  # aborted meanwhile
            out.seq = owner[1]
            by_client[owner[0]].append(out)
            if out.finished:
                del self._owners[out.request_id]
                self.counters["finished"] += 1
        for client, outs in by_client.items():
            self._send(client, outs)

    def _send(self, client: bytes, outputs: list[Output]) -> None:
        self._outbox.send(client, encode(OutputBatch(self.rank, outputs)))

    def _forget_client(self, client: bytes, why: str) -> None:
        """The client is gone (or hopelessly behind; the outbox dropped its backlog): abort its requests."""
        ids = [rid for rid, (owner, _) in self._owners.items() if owner == client]
        logger.warning("rank %d: client %s %s; aborting its %d requests", self.rank, client.hex(), why, len(ids))
        self._abort_ids(ids)

    def _fail_all(self, reason: str) -> None:
        by_client: dict[bytes, list[Output]] = defaultdict(list)
        for rid, (client, seq) in self._owners.items():
            by_client[client].append(Output(rid, [], True, "error", reason, seq))
        self._owners.clear()
        for client, outs in by_client.items():
            with contextlib.suppress(zmq.ZMQError):
                self._send(client, outs)

    def _publish_load(self, force: bool) -> None:
        now = time.monotonic()
        self._cache.maybe_send(now)
        self._adapters.maybe_send(now, force)
        if not force and now - self._last_load_sent < self._stats_gap:
            return
        load = self._load()
        alive_due = now - self._last_load_sent >= ALIVE_EVERY_S
        if load == self._last_load and not alive_due:
            return
        # A busy rank's work changes every step: on its own it is sent only as
        # often as the coordinator publishes, not at the counts' quicker pace.
        if load[:2] == self._last_load[:2] and not (force or alive_due) and now - self._last_load_sent < self._work_gap:
            return
        self._last_load, self._last_load_sent = load, now
        self._to_coordinator(EngineStats(rank=self.rank, waiting=load[0], running=load[1], work=load[2]))

    def _load(self) -> tuple[int, int, int]:
        """``(waiting, running, work)``; work is -1 from an engine without ``work()``."""
        waiting, running = self.engine.load()
        work = self.engine.work() if self._reports_work else -1  # type: ignore[attr-defined]
        return waiting, running, int(work)

    def _report_state(self) -> None:
        """Answer a restarted coordinator's ``Resync`` with this rank's load and wave position."""
        load = self._load()
        self._last_load, self._last_load_sent = load, time.monotonic()
        wave, stepping = self.lockstep.waves.position() if self.lockstep is not None else (0, False)
        self._to_coordinator(
            EngineReport(rank=self.rank, waiting=load[0], running=load[1], wave=wave, stepping=stepping, work=load[2])
        )
        self._cache.send_full()
        self._adapters.send_again(time.monotonic())

    def _to_coordinator(self, msg: Any) -> bool:
        return self.sockets.to_coordinator(msg)

    def _drop(self, sender: str, why: str) -> None:
        self._drops.drop(sender, why)
