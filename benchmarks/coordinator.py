"""The coordinator at scale, simulated: its CPU share and snapshot lag with 64 to 1,024 engines.

No Ray. Per case, in fresh ``spawn`` processes on this host:

* the real :class:`~raydp.coordinator.loop.CoordinatorLoop` (IPC, default
  socket options, stats interval 0.1 s, heartbeat 1 s) alone in its own
  process, so its CPU time (every thread, ZeroMQ's I/O thread included) is
  measured apart from everything else;
* ``N`` simulated engines: one PUSH socket per rank connected to the collect
  socket, driven by two sender processes at ``rate_hz`` per rank, evenly
  phased. Rank ``r``'s ``k``-th message is ``EngineStats(r, k % 8, k)``, so
  every message changes the state and its ``running`` count names it;
* a client: a SUB on the publish socket in this process, decoding every snapshot.

Lag: from the moment a sender sent ``(rank, k)`` to the arrival of the first
snapshot whose ``counts[rank].running >= k`` (one monotonic clock: one host),
for every message sent in the measured window. Messages handled per second
come from the snapshots too: the sum of ``running`` over the ranks counts the
messages applied. The stats interval (0.1 s) bounds the lag from below: a
change waits up to one interval for the next snapshot, so p50 ~ 50 ms, p99 ~ 100 ms.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from benchmarks.common import log

SENDER_PROCESSES = 2
TAIL_S = 0.5  # the client listens this long after the window, for its last messages' snapshots


@dataclass(frozen=True)
class CoordinatorSizes:
    warmup_s: float  # traffic before the measured window
    window_s: float


COORDINATOR_FULL = CoordinatorSizes(warmup_s=2.0, window_s=6.0)
COORDINATOR_QUICK = CoordinatorSizes(warmup_s=1.0, window_s=2.0)


@dataclass(frozen=True)
class Case:
    ranks: int
    rate_hz: float  # stats messages per rank per second
    cpu_target: float  # share of one core
    lag_p99_target_ms: float


# 256 ranks have no target of their own: they get 1,024's, which they must meet with room to spare.
CASES = (Case(64, 100.0, 0.20, 200.0), Case(256, 10.0, 0.50, 200.0), Case(1024, 10.0, 0.50, 200.0))


@dataclass(frozen=True)
class CoordinatorResult:
    ranks: int
    rate_hz: float
    window_s: float
    sent_per_s: float
    handled_per_s: float
    snapshots_per_s: float
    cpu_share: float  # coordinator process CPU seconds / wall seconds (1.0 = one core)
    lag_p50_ms: float
    lag_p99_ms: float
    lag_samples: int
    unseen: int  # messages of the window no snapshot showed before the client stopped listening
    snapshot_bytes: int
    cpu_target: float
    lag_p99_target_ms: float
    error: str = ""

    def cpu_met(self) -> bool:
        return self.cpu_share < self.cpu_target

    def lag_met(self) -> bool:
        return self.lag_p99_ms < self.lag_p99_target_ms and self.unseen == 0


# ---- the processes ------------------------------------------------------------------------


def _coordinator_main(ranks: int, conn: Connection) -> None:
    """The real loop; serves until the parent says stop (or goes away)."""
    from raydp.coordinator.loop import CoordinatorLoop
    from raydp.coordinator.state import CoordinatorState
    from raydp.wire.transport import SocketOptions

    state = CoordinatorState(engine_count=ranks, stats_interval_s=0.1, heartbeat_interval_s=1.0)
    loop = CoordinatorLoop(state, SocketOptions(), transport="ipc", node_id="bench", ipc_prefix="bench-coordinator")

    def wait_for_stop() -> None:
        try:
            conn.recv()
        except EOFError:
            pass
        loop.stop()

    conn.send((loop.endpoints.collect[0], loop.endpoints.publish[0]))
    threading.Thread(target=wait_for_stop, daemon=True).start()
    loop.run()


def _sender_main(address: str, ranks: list[int], total: int, rate_hz: float, conn: Connection) -> None:
    """One PUSH socket per rank; sends on a fixed schedule, records each send's time.

    Rank ``r`` sends at ``start + k / rate_hz + r / (total * rate_hz)``, and
    the loop sleeps until exactly then: engines on their own hosts send
    independently, so each message must reach the coordinator on its own.
    (Sleeping at least 1 ms and sending everything due in a burst halves the
    coordinator's CPU, flattering it.) A late send's recorded time is the real one.
    """
    import zmq

    from raydp.wire.codec import encode
    from raydp.wire.control import EngineStats
    from raydp.wire.transport import SocketOptions, make_socket

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socks = [make_socket(ctx, zmq.PUSH, SocketOptions()) for _ in ranks]
    for sock in socks:
        sock.connect(address)
    conn.send("ready")
    start, stop = conn.recv()
    period = 1.0 / rate_hz
    phases = [r / total * period for r in ranks]
    sent: list[list[float]] = [[] for _ in ranks]
    slot, count = 0, len(ranks)
    while True:
        cycle, i = divmod(slot, count)
        due = start + cycle * period + phases[i]
        if due >= stop:
            break
        now = time.monotonic()
        if due > now:
            time.sleep(due - now)
            continue
        seq = len(sent[i]) + 1
        sent[i].append(time.monotonic())
        socks[i].send(encode(EngineStats(rank=ranks[i], waiting=seq % 8, running=seq)))
        slot += 1
    conn.send((ranks, sent))
    ctx.destroy(linger=1000)


# ---- one case ----------------------------------------------------------------------------


@dataclass
class _Snapshots:
    times: list[float]
    running: list[Any]  # numpy arrays: per rank, the running count the snapshot showed
    sizes: list[int]


def _listen(sub: Any, until: float, ranks: int, on_time: list[tuple[float, Any]]) -> _Snapshots:
    """Receive snapshots until ``until``; call each ``(at, fn)`` of ``on_time`` when ``at`` passes."""
    import numpy as np
    import zmq

    from raydp.wire.control import snapshot_decoder

    got = _Snapshots([], [], [])
    pending = sorted(on_time, key=lambda p: p[0])
    while (now := time.monotonic()) < until:
        while pending and pending[0][0] <= now:
            pending.pop(0)[1]()
        wake = min([until] + [at for at, _ in pending[:1]])
        if not sub.poll(max(1, int((wake - now) * 1000)), zmq.POLLIN):
            continue
        body = sub.recv()
        arrived = time.monotonic()
        snap = snapshot_decoder(body)
        if len(snap.counts) != ranks:
            continue
        got.times.append(arrived)
        got.running.append(np.fromiter((r for _, r in snap.counts), dtype=np.int64, count=ranks))
        got.sizes.append(len(body))
    return got


def _lags(snaps: _Snapshots, sent: dict[int, list[float]], w0: float, w1: float) -> tuple[list[float], int]:
    """Per message sent in ``[w0, w1]``: first snapshot showing it minus its send time."""
    import numpy as np

    times = np.asarray(snaps.times)
    table = np.stack(snaps.running)  # [snapshot, rank]; each column never decreases (one PUSH per rank)
    lags: list[Any] = []
    unseen = 0
    for rank, stamps in sent.items():
        at = np.asarray(stamps)
        seqs = np.nonzero((at >= w0) & (at <= w1))[0] + 1
        first = np.searchsorted(table[:, rank], seqs, side="left")
        seen = first < len(times)
        unseen += int((~seen).sum())
        lags.append(times[first[seen]] - at[seqs[seen] - 1])
    return list(np.concatenate(lags)) if lags else [], unseen


def _handled_per_s(snaps: _Snapshots, w0: float, w1: float) -> tuple[float, float]:
    """Messages applied per second (the sum of ``running`` grows by one per message) and snapshots per second."""
    inside = [i for i, t in enumerate(snaps.times) if w0 <= t <= w1]
    if len(inside) < 2:
        return 0.0, 0.0
    a, b = inside[0], inside[-1]
    span = snaps.times[b] - snaps.times[a]
    applied = int(snaps.running[b].sum() - snaps.running[a].sum())
    return applied / span, (len(inside) - 1) / span


def _start_senders(ctx: Any, address: str, case: Case) -> list[tuple[Any, Connection]]:
    senders = []
    for j in range(SENDER_PROCESSES):
        mine, theirs = ctx.Pipe()
        ranks = list(range(j, case.ranks, SENDER_PROCESSES))
        proc = ctx.Process(target=_sender_main, args=(address, ranks, case.ranks, case.rate_hz, theirs), daemon=True)
        proc.start()
        senders.append((proc, mine))
    for _, conn in senders:
        if not conn.poll(60):
            raise TimeoutError("a sender process did not connect within 60 s")
        conn.recv()
    return senders


def _run_case(case: Case, sizes: CoordinatorSizes) -> CoordinatorResult:
    import numpy as np
    import psutil
    import zmq

    mp = multiprocessing.get_context("spawn")
    coord_conn, theirs = mp.Pipe()
    coordinator = mp.Process(target=_coordinator_main, args=(case.ranks, theirs), daemon=True)
    coordinator.start()
    zctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    senders: list[tuple[Any, Connection]] = []
    try:
        if not coord_conn.poll(60):
            raise TimeoutError("the coordinator did not start within 60 s")
        collect, publish = coord_conn.recv()
        sub = zctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(publish)
        senders = _start_senders(mp, collect, case)
        start = time.monotonic() + 0.2
        w0, w1 = start + sizes.warmup_s, start + sizes.warmup_s + sizes.window_s
        for _, conn in senders:
            conn.send((start, w1))
        proc = psutil.Process(coordinator.pid)
        cpu: list[float] = []

        def sample() -> None:
            t = proc.cpu_times()
            cpu.extend((time.monotonic(), t.user + t.system))

        snaps = _listen(sub, w1 + TAIL_S, case.ranks, [(w0, sample), (w1, sample)])
        sent: dict[int, list[float]] = {}
        for _, conn in senders:
            if not conn.poll(30):
                raise TimeoutError("a sender did not report its send times")
            ranks, stamps = conn.recv()
            sent.update(zip(ranks, stamps, strict=True))
        lags, unseen = _lags(snaps, sent, w0, w1)
        handled, snaps_per_s = _handled_per_s(snaps, w0, w1)
        in_window = sum(1 for stamps in sent.values() for t in stamps if w0 <= t <= w1)
        p50, p99 = (float(x) * 1000 for x in np.percentile(lags, [50, 99])) if lags else (float("nan"),) * 2
        return CoordinatorResult(
            case.ranks,
            case.rate_hz,
            sizes.window_s,
            in_window / sizes.window_s,
            handled,
            snaps_per_s,
            (cpu[3] - cpu[1]) / (cpu[2] - cpu[0]),
            p50,
            p99,
            len(lags),
            unseen,
            int(np.median(snaps.sizes)) if snaps.sizes else 0,
            case.cpu_target,
            case.lag_p99_target_ms,
        )
    finally:
        coord_conn.send("stop")
        for proc_, _ in senders:
            proc_.join(10)
        coordinator.join(10)
        for p in [coordinator] + [s for s, _ in senders]:
            if p.is_alive():
                p.kill()
        zctx.destroy(linger=0)


def _failed(case: Case, sizes: CoordinatorSizes, exc: BaseException) -> CoordinatorResult:
    nan = float("nan")
    return CoordinatorResult(
        case.ranks,
        case.rate_hz,
        sizes.window_s,
        nan,
        nan,
        nan,
        nan,
        nan,
        nan,
        0,
        0,
        0,
        case.cpu_target,
        case.lag_p99_target_ms,
        repr(exc)[:200],
    )


def coordinator_benchmark(sizes: CoordinatorSizes, cases: tuple[Case, ...] = CASES) -> list[CoordinatorResult]:
    results = []
    for case in cases:
        log(
            f"coordinator bench: {case.ranks} ranks at {case.rate_hz:g} Hz "
            f"({sizes.warmup_s:g} s warm-up, {sizes.window_s:g} s window)"
        )
        try:
            results.append(_run_case(case, sizes))
        except Exception as exc:  # a failed case is reported, not fatal
            log(f"coordinator bench: {case.ranks} ranks failed: {exc!r}")
            results.append(_failed(case, sizes, exc))
    return results


def coordinator_failed(results: list[CoordinatorResult]) -> bool:
    return any(r.error for r in results)


def coordinator_table(results: list[CoordinatorResult]) -> list[str]:
    lines = [
        "### Coordinator at scale (simulated engines, real loop and sockets)",
        "",
        "| ranks | stats rate | sent/s | handled/s | snapshots/s | coordinator CPU (of one core) "
        "| snapshot lag p50 | p99 | snapshot size | CPU target | lag p99 target |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        if r.error:
            lines.append(f"| {r.ranks} | {r.rate_hz:g} Hz | failed: {r.error} | | | | | | | | |")
            continue
        unseen = f" ({r.unseen} unseen)" if r.unseen else ""
        lines.append(
            f"| {r.ranks} | {r.rate_hz:g} Hz | {r.sent_per_s:,.0f} | {r.handled_per_s:,.0f} | {r.snapshots_per_s:.1f} "
            f"| {100 * r.cpu_share:.1f}% | {r.lag_p50_ms:.1f} ms | {r.lag_p99_ms:.1f} ms{unseen} "
            f"| {r.snapshot_bytes:,} B | < {100 * r.cpu_target:.0f}%: {'met' if r.cpu_met() else 'missed'} "
            f"| < {r.lag_p99_target_ms:.0f} ms: {'met' if r.lag_met() else 'missed'} |"
        )
    window = results[0].window_s if results else 0.0
    lines += [
        "",
        f"{window:g} s window per case after a warm-up; lag over every message sent in the window "
        f"({sum(r.lag_samples for r in results):,} in all). Stats interval 0.1 s, heartbeat 1 s; "
        f"{SENDER_PROCESSES} sender processes drive the PUSH sockets; CPU counts every thread of "
        "the coordinator's process.",
    ]
    return lines


if __name__ == "__main__":
    import sys

    chosen = COORDINATOR_QUICK if "--quick" in sys.argv else COORDINATOR_FULL
    print("\n".join(coordinator_table(coordinator_benchmark(chosen))))
