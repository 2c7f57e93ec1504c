"""The front-end client: spreads requests over the ranks and demultiplexes outputs.

A :class:`Client` is usable from a driver, a notebook, a Ray Job or an API
server process. Its sockets (:mod:`raydp.client.sockets`):

* one DEALER per engine (connected to the engine's input ROUTER; the engine
  answers on the same socket);
* a SUB on the coordinator's publish socket (load snapshots, wave, running);
* a PUSH to the coordinator's collect socket (``FirstRequest`` when the
  cluster is paused).

Threads take turns on them under one lock (:mod:`raydp.client.turns`): a user
thread sends its request itself while the client is quiet, and reads its own
answer; the client's IO thread sends bursts under load and reads outputs,
snapshots and liveness notices. The tables (requests, calls, dead ranks, the
balancer: :mod:`raydp.client.router`) belong to whoever holds the lock.

The rank for a request is picked at send time
(:class:`~raydp.client.balancer.LoadBalancer`); an explicit ``rank`` pins it.

A request submitted ``migratable=True`` survives the death of its rank
mid-stream: it continues on a live rank from its last token (the prompt plus
what it streamed, with the tokens left), up to ``migration_limit`` times;
then, or without the opt-in, it fails with the rank's
:class:`~raydp.errors.EngineDeadError`. ``Client.migrations`` counts the moves.

Over P/D pools (:mod:`raydp.client.pools`) a request prefills on a prefill
rank and decodes on a decode rank; ``kv_timeout_s`` bounds the wait for the
decode rank's first token, past which the request fails with
:class:`~raydp.errors.KVTransferError`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import Future
from typing import Any

from raydp.client.balancer import DEFAULT_PREFIX_LOAD_MARGIN, LoadBalancer, Policy
from raydp.client.pools import DEFAULT_KV_TIMEOUT_S
from raydp.client.requests import RequestHandle, Submission
from raydp.client.router import RequestRouter
from raydp.client.sockets import ClientSockets
from raydp.client.turns import ClientTurns
from raydp.errors import (
    ConfigError,
    EngineDeadError,
)
from raydp.wire.adapters import check_adapter_name
from raydp.wire.codec import encode
from raydp.wire.control import StatsSnapshot
from raydp.wire.endpoints import ClusterEndpoints, CoordinatorEndpoints, EngineEndpoint
from raydp.wire.protocol import MAX_TOKEN_ID, Request, UtilityCall
from raydp.wire.sampling import Sampling
from raydp.wire.transport import SocketOptions


class Client:
    """Send requests to a running cluster; see the module docstring."""

    def __init__(
        self,
        endpoints: ClusterEndpoints,
        *,
        node_id: str | None = None,
        client_index: int = 0,
        client_count: int = 1,
        options: SocketOptions | None = None,
        follow_liveness: bool = True,
        ranks: Collection[int] | None = None,
        balancer: Policy = "least-loaded",
        migration_limit: int = 3,
        prefix_load_margin: int = DEFAULT_PREFIX_LOAD_MARGIN,
        adapter_affinity: bool = True,
        kv_timeout_s: float = DEFAULT_KV_TIMEOUT_S,
        owner: object = None,
    ) -> None:
        # What made this client (a Cluster handle) lives as long as it does:
        # ``raydp.attach(name).client()`` drops the handle at once, and its
        # finalizer would otherwise close the client under the caller.
        self._owner = owner
        if not 0 <= client_index < client_count:
            raise ConfigError(f"client_index={client_index}: must be in [0, client_count={client_count})")
        if isinstance(migration_limit, bool) or not isinstance(migration_limit, int) or migration_limit < 0:
            raise ConfigError(f"migration_limit={migration_limit!r}: must be an int >= 0 (moves of one stream)")
        self.migration_limit = migration_limit
        if isinstance(kv_timeout_s, bool) or not isinstance(kv_timeout_s, int | float) or not kv_timeout_s > 0:
            raise ConfigError(f"kv_timeout_s={kv_timeout_s!r}: must be a number of seconds > 0")
        self.client_index, self.client_count = client_index, client_count
        policy = LoadBalancer(
            len(endpoints.engines),
            client_count,
            ranks,
            balancer,
            prefix_load_margin=prefix_load_margin,
            adapter_affinity=adapter_affinity,
        )
        self._call_ids = itertools.count(1)
        self._ids = itertools.count()
        self._io = ClientSockets(endpoints, node_id, options or SocketOptions())
        self._router = RequestRouter(
            endpoints, self._io, policy, follow_liveness=follow_liveness, last_heard=time.monotonic()
        )
        self._router.kv_waits.timeout_s = float(kv_timeout_s)
        self._id_prefix = self._io.identity.hex()  # request ids: unique per client, then a counter
        self._turns = ClientTurns(
            self._io, self._router, follow_liveness=follow_liveness, heartbeat_interval_s=endpoints.heartbeat_interval_s
        )

    # ---- public API (any thread) --------------------------------------------------

    def submit(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int = 16,
        *,
        rank: int | None = None,
        request_id: str | None = None,
        retryable: bool = False,
        sampling: Sampling | None = None,
        migratable: bool = False,
        adapter: str = "",
    ) -> RequestHandle:
        """Send one request; returns at once with a handle to wait on or stream.

        ``sampling`` (a :class:`~raydp.Sampling`) sets temperature, top_p, top_k,
        seed, stop strings and tokens, ignore_eos; None decodes greedily. An
        engine that cannot honour a field fails the request naming it.
        ``migratable``: see the module docstring (not with ``rank``).
        ``adapter``: the LoRA adapter to run with ("": the base model); the
        request goes to a rank that holds it where one is not too busy.
        """
        request = self.request_for(prompt_token_ids, max_tokens, rank, request_id, sampling, adapter)
        moves = self.migrations_for(migratable, rank)
        handle = RequestHandle(request.request_id, self._turns.read_for)
        self._turns.run([Submission(request, rank, handle.deliver, retryable, handle, awaited=True, migrations=moves)])
        return handle

    def submit_many(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: int = 16,
        *,
        retryable: bool = False,
        sampling: Sampling | None = None,
        migratable: bool = False,
        adapter: str = "",
    ) -> list[RequestHandle]:
        """Send many requests at once: one turn of the client's lock and one message per rank.

        Each request still goes to the least-loaded rank at send time (the
        choices spread, as for single submits). Returns one handle per prompt,
        in order; a bad prompt raises ConfigError (naming its index) before
        anything is sent.
        """
        items: list[Submission] = []
        moves = self.migrations_for(migratable, None)
        for i, prompt in enumerate(prompts):
            try:
                request = self.request_for(prompt, max_tokens, None, None, sampling, adapter)
            except ConfigError as exc:
                raise ConfigError(f"prompts[{i}]: {exc}") from None
            handle = RequestHandle(request.request_id, self._turns.read_for)
            items.append(Submission(request, None, handle.deliver, retryable, handle, awaited=True, migrations=moves))
        self.send_batch(items)
        return [item.handle for item in items if item.handle is not None]

    def generate(
        self, prompt_token_ids: Sequence[int], max_tokens: int = 16, *, timeout: float | None = 60.0, **kw: Any
    ) -> list[int]:
        """Send one request and wait for all its tokens."""
        return self.submit(prompt_token_ids, max_tokens, **kw).result(timeout)

    def abort(self, request_id: str) -> None:
        """Abort an in-flight request: its handle finishes with ``finish_reason='abort'``
        and the tokens produced so far; the engine drops it."""
        self._turns.run(lambda: self._router.abort(request_id))

    def call_utility(self, rank: int, method: str, *args: Any, timeout: float = 30.0) -> Any:
        """Call ``method(*args)`` on rank ``rank``'s engine core; msgpack-native args only."""
        self._check_rank(rank, draining_ok=True)
        future: Future[Any] = Future()
        call_id = next(self._call_ids)
        try:  # encode here, so unencodable arguments fail in the caller
            body = encode(UtilityCall(call_id, method, list(args)))
        except TypeError as exc:
            raise ConfigError(f"args={args!r}: not msgpack-encodable ({exc})") from None
        self._turns.run(lambda: self._router.call(rank, call_id, method, future, body))
        try:
            return future.result(timeout)
        except BaseException:
            # Timed out or interrupted: nobody waits for this answer any more, so
            # the entry goes; a late answer is ignored.
            if not future.done():
                self._turns.run(lambda: self._router.calls.forget(call_id), allow_closed=True)
            raise

    @property
    def migrations(self) -> int:
        """Streams this client moved to another rank after their rank died."""
        return self._router.migrations

    def migrations_for(self, migratable: bool, rank: int | None) -> int:
        """How many times a request may move (0: it fails with its rank); raises ConfigError for a pinned one."""
        if not isinstance(migratable, bool):
            raise ConfigError(f"migratable={migratable!r}: must be True or False")
        if migratable and rank is not None:
            raise ConfigError(
                f"migratable=True with rank={rank}: a request pinned to a rank cannot move; "
                "leave rank unset, or migratable False"
            )
        return self.migration_limit if migratable else 0

    def cached_blocks(self) -> list[int]:
        """Per rank, the prefix-cache blocks this client knows the rank holds (what ``prefix`` routes on)."""
        cache = self._router.balancer.cache
        return [cache.blocks(rank) for rank in range(self._router.balancer.engine_count)]

    def in_flight(self) -> list[int]:
        """Per rank, this client's requests sent there and not finished: known at once, where the coordinator's
        snapshot counts lag by a stats interval (and stay at their last value while an engine is stopped)."""
        balancer = self._router.balancer
        return [balancer.in_flight(rank) for rank in range(balancer.engine_count)]

    def adapter_paths(self) -> dict[str, str]:
        """The LoRA adapters the ranks were given by name (vLLM's ``add_lora``), with their paths."""
        return self._router.balancer.adapters.known()

    def snapshot(self) -> StatsSnapshot | None:
        """The latest (counts, wave, running) published by the coordinator."""
        return self._router.feed.last_snapshot

    def live_ranks(self) -> list[int]:
        """The ranks new requests go to that the coordinator's latest snapshot does not report dead."""
        snap = self.snapshot()
        dead = set(snap.dead) if snap is not None else set()
        return [rank for rank in range(self.dp_size) if rank not in dead]

    def mark_dead(self, error: EngineDeadError) -> None:
        """Fail (or retry elsewhere) the requests on a dead rank; stop routing to it."""
        self._turns.run(lambda: self._router.mark_dead(error), allow_closed=True)

    def follow_coordinator(self, coord: CoordinatorEndpoints) -> None:
        """The coordinator restarted on another node: reconnect to it there."""
        self._turns.run(lambda: self._turns.follow_coordinator(coord), allow_closed=True)

    def revive(self, endpoint: EngineEndpoint) -> None:
        """A restarted rank is back at ``endpoint``: reconnect and route to it again."""
        self._turns.run(lambda: self._router.revive(endpoint), allow_closed=True)

    def rescale(self, endpoints: ClusterEndpoints, size: int, drain_timeout_s: float | None = None) -> None:
        """Follow a scale change: hold ``endpoints.engines``, send new requests to the first ``size``.

        Ranks at or above ``size`` drain: their requests go on, except retryable
        ones with no output yet, which move to a remaining rank. A rank no
        longer in ``endpoints`` is gone: what is still on it fails with
        :class:`~raydp.errors.ScaleDownError`. A P/D cluster's pools follow
        ``endpoints.prefill_ranks``. Clients in other processes do this on
        their own, from the coordinator's snapshots.
        """

        def follow() -> None:
            self._router.rescale(list(endpoints.engines), size, drain_timeout_s)
            if endpoints.prefill_ranks:
                self._router.move_pools(endpoints.prefill_ranks)

        # Back in the caller, the change is in effect: a request sent next sees the new ranks.
        self._turns.run(follow, True, now=True)

    @property
    def endpoints(self) -> ClusterEndpoints:
        """Where the cluster's sockets are, as this client last learned (restarts and scale changes move them)."""
        return self._router.endpoints

    @property
    def dp_size(self) -> int:
        """How many ranks this client sends new requests to."""
        return self._router.balancer.size

    def close(self) -> None:
        """Fail what is in flight with ClusterClosedError, stop the IO thread, close sockets."""
        self._turns.close()

    @property
    def closer(self) -> Callable[[], None]:
        """What :meth:`close` runs, holding none of this client (for a finalizer of its owner)."""
        return self._turns.close

    @property
    def closed(self) -> bool:
        return self._turns.closed

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- validation -------------------------------------------------------------------

    def request_for(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        rank: int | None,
        request_id: str | None,
        sampling: Sampling | None = None,
        adapter: str = "",
    ) -> Request:
        """The validated request a submit of these arguments sends (``AsyncClient`` builds on it)."""
        if not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_TOKEN_ID:
            raise ConfigError(f"max_tokens={max_tokens!r}: must be an int in [1, {MAX_TOKEN_ID}]")
        tokens = list(prompt)
        for i, t in enumerate(tokens):
            if not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID:
                raise ConfigError(f"prompt_token_ids[{i}]={t!r}: must be an int in [0, {MAX_TOKEN_ID}]")
        if rank is not None:
            self._check_rank(rank)
        if request_id is not None and (not isinstance(request_id, str) or not request_id):
            raise ConfigError(f"request_id={request_id!r}: must be a non-empty str")
        if sampling is not None and not isinstance(sampling, Sampling):
            raise ConfigError(f"sampling={sampling!r}: must be a raydp.Sampling or None")
        why = check_adapter_name(adapter)
        if why:
            raise ConfigError(why)
        rid = request_id or f"{self._id_prefix}-{next(self._ids)}"
        return Request(rid, tokens, max_tokens, arrival_time=time.time(), sampling=sampling, adapter=adapter)

    def _check_rank(self, rank: int, draining_ok: bool = False) -> None:
        n = len(self.endpoints.engines) if draining_ok else self._router.balancer.size
        if not isinstance(rank, int) or not 0 <= rank < n:
            raise ConfigError(f"rank={rank!r}: must be an int in [0, {n})")

    def send_batch(self, items: list[Submission]) -> None:
        """Many submissions under one turn of the lock, one message per rank."""
        if items:
            self._turns.run(items)
