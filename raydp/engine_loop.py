"""The per-rank busy loop: poll inputs, add/abort, step, send outputs, publish load.

:class:`EngineLoop` owns one rank's sockets once the handshake is done:

* ``input`` ROUTER (bound): ``[client_id, tag, body]`` from clients; outputs go
  back to the owning client as ``[client_id, OutputBatch]``;
* ``collect`` PUSH to the coordinator: load, ``WaveComplete``, ``StartWave``;
* ``broadcast`` SUB from the coordinator: ``StartDPWave`` and ``Shutdown``;
* ``wake`` PAIR (inproc): another thread of the process asks it to stop.

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

import zmq

from raydp.collective import DPCollective
from raydp.engine import EngineCore
from raydp.errors import ProtocolError
from raydp.protocol import (
    BROADCAST_TOPIC,
    Abort,
    EngineStats,
    Output,
    OutputBatch,
    Request,
    Shutdown,
    StartDPWave,
    StartWave,
    UtilityCall,
    UtilityResult,
    WaveComplete,
    decode_input,
    encode,
    engine_broadcast_decoder,
    presence_topic,
)
from raydp.waves import EngineWaves

logger = logging.getLogger("raydp.engine")
IDLE_POLL_MS = 1000


class EngineSockets:
    """The sockets of one running rank (created by the actor, owned by the loop)."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        input: zmq.Socket[bytes],
        collect: zmq.Socket[bytes],
        broadcast: zmq.Socket[bytes],
        wake_address: str,
        rank: int,
    ) -> None:
        self.ctx, self.input, self.collect, self.broadcast = ctx, input, collect, broadcast
        broadcast.setsockopt(zmq.SUBSCRIBE, BROADCAST_TOPIC)
        broadcast.setsockopt(zmq.SUBSCRIBE, presence_topic(rank))
        self.wake = ctx.socket(zmq.PAIR)
        self.wake.bind(wake_address)
        self.poller = zmq.Poller()
        for sock in (input, broadcast, self.wake):
            self.poller.register(sock, zmq.POLLIN)

    def close(self) -> None:
        for sock in (self.input, self.collect, self.broadcast, self.wake):
            sock.close(linger=0)


class EngineLoop:
    """Drives one user engine core; see the module docstring for the protocol."""

    def __init__(
        self,
        engine: EngineCore,
        rank: int,
        sockets: EngineSockets,
        *,
        waves: EngineWaves | None = None,
        collective: DPCollective | None = None,
        stats_interval_s: float = 0.1,
    ) -> None:
        self.engine, self.rank, self.sockets = engine, rank, sockets
        self.waves, self.collective = waves, collective
        self._stats_gap = min(stats_interval_s / 2, 0.01)
        self._owners: dict[str, bytes] = {}
        self._last_load: tuple[int, int] = (-1, -1)
        self._last_load_sent = 0.0
        self._stopping = False
        self.dropped = 0

    # ---- the loop ---------------------------------------------------------------

    def run(self) -> None:
        """Loop until a Shutdown broadcast or :meth:`stop`; re-raises engine failures."""
        try:
            while not self._stopping:
                self._poll_inputs()
                if self._stopping:
                    break
                if self._should_step():
                    self._step_once()
                self._publish_load(force=not self._should_step())
        except BaseException as exc:
            self._fail_all(f"engine rank {self.rank} failed: {exc!r}")
            raise

    def stop(self) -> None:
        """Ask the loop to leave; safe from any thread via the wake socket."""
        self._stopping = True

    def _should_step(self) -> bool:
        has_work = self.engine.has_unfinished()
        return self.waves.should_step(has_work) if self.waves else has_work

    def _poll_inputs(self) -> None:
        timeout = 0 if self._should_step() else IDLE_POLL_MS
        events = dict(self.sockets.poller.poll(timeout))
        while events:
            if self.sockets.wake in events:
                self._stopping = True
                return
            if self.sockets.broadcast in events:
                self._on_broadcast(self.sockets.broadcast.recv_multipart())
            if self.sockets.input in events:
                self._on_input(self.sockets.input.recv_multipart(copy=True))
            events = dict(self.sockets.poller.poll(0))

    def _step_once(self) -> None:
        if self.engine.has_unfinished():
            self._send_outputs(self.engine.step())
        else:
            self.engine.execute_dummy_batch()
        if self.waves is not None and self.waves.after_step():
            assert self.collective is not None, "lockstep needs a DP collective"
            everyone = self.collective.any_unfinished(self.engine.has_unfinished())
            completed = self.waves.on_allreduce(everyone)
            if completed is not None and self.rank == 0:
                self._to_coordinator(WaveComplete(rank=0, wave=completed))

    # ---- inputs ----------------------------------------------------------------

    def _on_input(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            return self._drop(f"input with {len(frames)} frames (want 3)")
        client, tag, body = frames
        try:
            msg = decode_input(tag, body)
        except ProtocolError as exc:
            return self._drop(str(exc))
        if isinstance(msg, Request):
            self._add(client, msg)
        elif isinstance(msg, Abort):
            self._abort(msg)
        else:
            self._utility(client, msg)
        return None

    def _add(self, client: bytes, request: Request) -> None:
        rid = request.request_id
        if rid in self._owners:
            self._send(client, [Output(rid, [], True, "error", f"duplicate request id {rid!r}")])
            return
        if self.waves is not None:
            start = self.waves.on_request(request.wave)
            if start is not None:
                self._to_coordinator(StartWave(rank=self.rank, wave=start))
        try:
            self.engine.add_request(request)
        except Exception as exc:  # the user's engine refused this one request
            self._send(client, [Output(rid, [], True, "error", f"rejected by engine: {exc!r}")])
            return
        self._owners[rid] = client

    def _abort(self, msg: Abort) -> None:
        ids = [rid for rid in msg.request_ids if rid in self._owners]
        if ids:
            self.engine.abort(ids)
            for rid in ids:
                del self._owners[rid]

    def _utility(self, client: bytes, call: UtilityCall) -> None:
        result = UtilityResult(call.call_id)
        try:
            if call.method.startswith("_"):
                raise AttributeError(f"{call.method!r} is private")
            result.result = getattr(self.engine, call.method)(*call.args)
        except Exception as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        self._send_batch(client, OutputBatch(self.rank, [], result))

    def _on_broadcast(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            return self._drop(f"broadcast with {len(frames)} frames (want 2)")
        try:
            msg = engine_broadcast_decoder(frames[1])
        except ProtocolError as exc:
            return self._drop(str(exc))
        if isinstance(msg, Shutdown):
            self._stopping = True
        elif isinstance(msg, StartDPWave) and self.waves is not None:
            self.waves.on_start_wave(msg.wave, msg.exclude)
        return None

    # ---- outputs ---------------------------------------------------------------

    def _send_outputs(self, outputs: list[Output]) -> None:
        by_client: dict[bytes, list[Output]] = defaultdict(list)
        for out in outputs:
            owner = self._owners.get(out.request_id)
            if owner is None:
                continue  # aborted meanwhile
            by_client[owner].append(out)
            if out.finished:
                del self._owners[out.request_id]
        for client, outs in by_client.items():
            self._send(client, outs)

    def _send(self, client: bytes, outputs: list[Output]) -> None:
        self._send_batch(client, OutputBatch(self.rank, outputs))

    def _send_batch(self, client: bytes, batch: OutputBatch) -> None:
        try:
            self.sockets.input.send_multipart([client, encode(batch)], copy=False)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._forget_client(client)

    def _forget_client(self, client: bytes) -> None:
        """The client went away: its requests have nobody to report to, abort them."""
        ids = [rid for rid, owner in self._owners.items() if owner == client]
        logger.warning("rank %d: client %s is gone; aborting %d requests", self.rank, client.hex(), len(ids))
        if ids:
            self.engine.abort(ids)
            for rid in ids:
                del self._owners[rid]

    def _fail_all(self, reason: str) -> None:
        by_client: dict[bytes, list[Output]] = defaultdict(list)
        for rid, client in self._owners.items():
            by_client[client].append(Output(rid, [], True, "error", reason))
        self._owners.clear()
        for client, outs in by_client.items():
            with contextlib.suppress(zmq.ZMQError):
                self._send(client, outs)

    def _publish_load(self, force: bool) -> None:
        load = self.engine.load()
        now = time.monotonic()
        if load == self._last_load or (not force and now - self._last_load_sent < self._stats_gap):
            return
        self._last_load, self._last_load_sent = load, now
        self._to_coordinator(EngineStats(rank=self.rank, waiting=load[0], running=load[1]))

    def _to_coordinator(self, msg: Any) -> None:
        self.sockets.collect.send(encode(msg), copy=False)

    def _drop(self, why: str) -> None:
        self.dropped += 1
        logger.warning("rank %d: dropped malformed message: %s", self.rank, why)
