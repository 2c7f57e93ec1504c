"""Steady, bounded load with exact accounting, for the chaos soak and the failure benchmark.

Every request ends in exactly one outcome:

* ``ok``: answered once, with the right tokens (:class:`Answers`): the echo
  engine's (for a stream that moved to another rank when its rank died, what
  the echo of each continuation gives: :func:`echo_moves`), or a greedy
  model's, as one unbroken run answered each prompt (:func:`greedy_answers`);
* ``typed``: failed with a :class:`~raydp.RaydpError` (driver) or an HTTP
  error in OpenAI's JSON shape; for HTTP also a connection closed by an API
  server that was killed while the request was on it (nothing else closes one);
* ``wrong``: answered with other tokens; ``duplicate``: answered, then given
  more tokens or an error afterwards (it was answered twice);
* ``hung``: no answer within ``hung_after_s``; ``untyped``: any other failure.

``lost`` is hung plus submitted-but-never-accounted (silently dropped).
``migrated`` counts, per source, the answers whose stream moved, and the moves.
Load is bounded twice: a fixed number of threads (the concurrency) and a
shared pacer (the requests per second).
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import json
import os
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import raydp
from raydp.client.client import Client
from raydp.client.requests import RequestHandle
from raydp.wire.sampling import Sampling

OUTCOMES = ("ok", "typed", "wrong", "duplicate", "hung", "untyped")
RECHECK_AFTER_S = 2.0  # an answered request is looked at again this long after, for a second answer


def expected(prompt: list[int], max_tokens: int) -> list[int]:
    """What ``raydp.models.echo:EchoEngine`` (and its worker variant) answers: the prompt, cycled."""
    return [prompt[i % len(prompt)] for i in range(max_tokens)]


def echo_moves(prompt: list[int], max_tokens: int, got: list[int]) -> int | None:
    """How many times ``got`` moved to another rank, if it is a whole echo answer whose stream migrated; None if
    it is not one (wrong, repeated or missing tokens).

    A stream that moves after ``k`` tokens goes on as a new request whose prompt is the prompt plus those
    tokens, which the echo engine cycles from its start; so every segment of the answer is the cycle of what
    came before it, and only a segment's first token may break the previous cycle.
    """
    if len(got) != max_tokens:
        return None
    moves, start, context = 0, 0, list(prompt)
    for i, token in enumerate(got):
        if token == context[(i - start) % len(context)]:
            continue
        if i == start:  # a new segment must begin with its context's first token
            return None
        moves, start, context = moves + 1, i, [*prompt, *got[:i]]
        if token != context[0]:
            return None
    return moves


def echo_prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(1, 256) for _ in range(rng.randrange(1, 4))]


@dataclass(frozen=True)
class Answers:
    """What the load sends and what a right answer is.

    ``moves`` judges an answer: how many times its stream moved to another rank, or None if it is wrong.
    ``sampling`` and ``http_fields`` go with every driver and HTTP request.
    """

    prompt: Callable[[random.Random], list[int]] = echo_prompt
    moves: Callable[[list[int], int, list[int]], int | None] = echo_moves
    sampling: Sampling | None = None
    http_fields: dict[str, Any] = field(default_factory=dict)


def greedy_answers(table: dict[tuple[int, ...], list[int]]) -> Answers:
    """A greedy model's answers: each prompt of ``table``, whose value is what an unbroken run answered it (at
    least as many tokens as any request asks; ``ignore_eos``, so every answer is that long). A stream that
    moved is right only if it equals that run's: a move shows as nothing, so it counts as 0 moves."""
    prompts = sorted(table)

    def moves(prompt: list[int], max_tokens: int, got: list[int]) -> int | None:
        return 0 if got == table[tuple(prompt)][:max_tokens] else None

    return Answers(
        prompt=lambda rng: list(rng.choice(prompts)),
        moves=moves,
        sampling=Sampling(temperature=0.0, ignore_eos=True),
        http_fields={"temperature": 0.0, "ignore_eos": True, "return_token_ids": True},
    )


@dataclass
class Ledger:
    """Submitted requests and their outcomes, per source (``driver``, ``http``)."""

    answers: Answers = field(default_factory=Answers)
    lock: threading.Lock = field(default_factory=threading.Lock)
    submitted: collections.Counter[str] = field(default_factory=collections.Counter)
    outcomes: dict[str, collections.Counter[str]] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)  # the first few violations, for the message
    migrated: collections.Counter[str] = field(default_factory=collections.Counter)  # answers that moved
    moves: collections.Counter[str] = field(default_factory=collections.Counter)

    def judge(self, source: str, prompt: list[int], max_tokens: int, got: list[int]) -> bool:
        """Record an answer: ``ok`` (counting a migrated one) or ``wrong``; True if ok."""
        moves = self.answers.moves(prompt, max_tokens, got)
        if moves is None:
            self.record(source, "wrong", f"prompt {prompt} x{max_tokens}: got {got}")
            return False
        if moves:
            with self.lock:
                self.migrated[source] += 1
                self.moves[source] += moves
        return True

    def submit(self, source: str) -> None:
        with self.lock:
            self.submitted[source] += 1

    def record(self, source: str, outcome: str, detail: str = "") -> None:
        with self.lock:
            self.outcomes.setdefault(source, collections.Counter())[outcome] += 1
            if outcome not in ("ok", "typed") and len(self.examples) < 10:
                self.examples.append(f"{source} {outcome}: {detail}"[:300])

    def total(self, outcome: str) -> int:
        with self.lock:
            return sum(c[outcome] for c in self.outcomes.values())

    def unaccounted(self) -> int:
        with self.lock:
            return sum(self.submitted.values()) - sum(sum(c.values()) for c in self.outcomes.values())

    def lost(self) -> int:
        return self.total("hung") + self.unaccounted()

    def summary(self) -> dict[str, Any]:
        with self.lock:
            by_source = {
                s: {o: self.outcomes.get(s, collections.Counter())[o] for o in OUTCOMES} for s in sorted(self.submitted)
            }
            submitted = dict(self.submitted)
            migrated = {s: {"streams": self.migrated[s], "moves": self.moves[s]} for s in sorted(self.submitted)}
        return {
            "submitted": submitted,
            "outcomes": by_source,
            "lost": self.lost(),
            "examples": list(self.examples),
            "migrated": migrated,
        }


class Pacer:
    """At most ``rate`` starts per second, shared by every load thread."""

    def __init__(self, rate: float, stop: threading.Event) -> None:
        self._gap, self._stop = 1.0 / rate, stop
        self._next = time.monotonic()
        self._lock = threading.Lock()

    def wait(self) -> bool:
        """Sleep until this thread's slot; False once stopping."""
        with self._lock:
            slot = max(self._next, time.monotonic())
            self._next = slot + self._gap
        return not self._stop.wait(max(0.0, slot - time.monotonic()))


@dataclass(frozen=True)
class LoadShape:
    rate: float  # requests per second, at most
    concurrency: int  # requests in flight, at most
    max_tokens: tuple[int, int] = (4, 24)  # drawn per request
    hung_after_s: float = 60.0


class _Load:
    """Threads that each send one request at a time, paced together; :meth:`stop` waits for them."""

    source = ""

    def __init__(self, ledger: Ledger, shape: LoadShape, seed: int) -> None:
        self.ledger, self.shape = ledger, shape
        self._stop = threading.Event()
        self._pacer = Pacer(shape.rate, self._stop)
        self._threads = [
            threading.Thread(
                target=self._loop, args=(random.Random(seed * 1000 + i),), name=f"load-{self.source}-{i}", daemon=True
            )
            for i in range(shape.concurrency)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def _loop(self, rng: random.Random) -> None:
        while self._pacer.wait():
            prompt = self.ledger.answers.prompt(rng)
            self.ledger.submit(self.source)
            self.one(prompt, rng.randrange(*self.shape.max_tokens))

    def one(self, prompt: list[int], max_tokens: int) -> None:
        raise NotImplementedError

    def stop(self) -> int:
        """Stop sending; wait for what is in flight. Returns the threads still stuck (each one a lost request)."""
        self._stop.set()
        deadline = time.monotonic() + self.shape.hung_after_s + 15
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return sum(t.is_alive() for t in self._threads)


class DriverLoad(_Load):
    """Requests from a driver :class:`Client`, ``retryable`` (moved to another rank if nothing streamed yet) and
    ``migratable`` (moved, from their last token, if something had)."""

    source = "driver"

    def __init__(self, client: Client, ledger: Ledger, shape: LoadShape, seed: int) -> None:
        super().__init__(ledger, shape, seed)
        self.client = client
        self._answered: collections.deque[tuple[float, RequestHandle, list[int]]] = collections.deque()
        self._answered_lock = threading.Lock()
        self._checker = threading.Thread(target=self._recheck_loop, name="load-driver-recheck", daemon=True)

    def start(self) -> None:
        super().start()
        self._checker.start()

    def one(self, prompt: list[int], max_tokens: int) -> None:
        try:
            sampling = self.ledger.answers.sampling
            handle = self.client.submit(prompt, max_tokens, retryable=True, migratable=True, sampling=sampling)
            got = handle.result(timeout=self.shape.hung_after_s)
        except raydp.RaydpError as exc:
            self.ledger.record(self.source, "typed", repr(exc))
            return
        except TimeoutError as exc:
            self.ledger.record(self.source, "hung", str(exc))
            return
        except Exception as exc:
            self.ledger.record(self.source, "untyped", repr(exc))
            return
        if not self.ledger.judge(self.source, prompt, max_tokens, got):
            return
        with self._answered_lock:  # counted once a second answer has had time to arrive
            self._answered.append((time.monotonic() + RECHECK_AFTER_S, handle, got))

    def _recheck_loop(self) -> None:
        while True:
            stopping = self._stop.is_set() and not any(t.is_alive() for t in self._threads)
            now = float("inf") if stopping else time.monotonic()
            with self._answered_lock:
                due = []
                while self._answered and self._answered[0][0] <= now:
                    due.append(self._answered.popleft())
            for _, handle, want in due:
                if handle.tokens == want and handle.error is None:
                    self.ledger.record(self.source, "ok")
                else:
                    self.ledger.record(
                        self.source, "duplicate", f"{handle.request_id}: then {handle.tokens} / {handle.error!r}"
                    )
            if stopping:
                return
            time.sleep(0.2)

    def stop(self) -> int:
        stuck = super().stop()
        self._checker.join(RECHECK_AFTER_S + 10)
        return stuck


class HttpLoad(_Load):
    """``POST /v1/completions`` to the API servers, one new connection per request (no retries)."""

    source = "http"

    def __init__(
        self,
        url: str,
        ledger: Ledger,
        shape: LoadShape,
        seed: int,
        server_killed_between: Callable[[float, float], bool],
    ) -> None:
        super().__init__(ledger, shape, seed)
        parts = urlsplit(url)
        assert parts.hostname is not None and parts.port is not None
        self._host, self._port = parts.hostname, parts.port
        self._killed_between = server_killed_between

    def one(self, prompt: list[int], max_tokens: int) -> None:
        started = time.monotonic()
        conn = http.client.HTTPConnection(self._host, self._port, timeout=self.shape.hung_after_s)
        try:
            conn.request(
                "POST",
                "/v1/completions",
                json.dumps({"prompt": prompt, "max_tokens": max_tokens, **self.ledger.answers.http_fields}),
                {"Content-Type": "application/json"},
            )
            answer = conn.getresponse()
            status, body = answer.status, answer.read()
        except TimeoutError as exc:
            self.ledger.record(self.source, "hung", repr(exc))
            return
        except (ConnectionError, http.client.HTTPException) as exc:
            # Only a killed API server closes a connection mid-request; then it is that fault's typed failure.
            killed = self._killed_between(started, time.monotonic())
            self.ledger.record(self.source, "typed" if killed else "untyped", f"{exc!r} (server killed: {killed})")
            return
        finally:
            conn.close()
        self._judge(prompt, max_tokens, status, body)

    def _judge(self, prompt: list[int], max_tokens: int, status: int, body: bytes) -> None:
        try:
            data = json.loads(body)
        except ValueError:
            self.ledger.record(self.source, "untyped", f"status {status}, not JSON: {body[:100]!r}")
            return
        if status != 200:
            error = data.get("error") if isinstance(data, dict) else None
            typed = isinstance(error, dict) and {"message", "type"} <= error.keys()
            self.ledger.record(self.source, "typed" if typed else "untyped", f"status {status}: {body[:200]!r}")
            return
        if self.ledger.judge(self.source, prompt, max_tokens, data["choices"][0]["token_ids"]):
            self.ledger.record(self.source, "ok")


@dataclass
class Sample:
    at: float
    rss: int
    fds: int


class ResourceSampler:
    """The driver's RSS and open fds every ``interval_s``, on a thread of its own."""

    def __init__(self, interval_s: float = 1.0) -> None:
        import psutil

        self._proc = psutil.Process(os.getpid())
        self.samples: list[Sample] = []
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="resource-sampler", daemon=True)

    def take(self) -> Sample:
        sample = Sample(time.monotonic(), self._proc.memory_info().rss, self._proc.num_fds())
        self.samples.append(sample)
        return sample

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            with contextlib.suppress(Exception):
                self.take()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
