"""The raydp exception tree.

Every error raydp raises on purpose derives from :class:`RaydpError`, so
``except raydp.RaydpError`` catches all of them and nothing else::

    RaydpError
    ├── ConfigError            bad input at a public entry point (also a ValueError)
    ├── PlacementError         the plan does not fit the cluster
    │   └── PlacementTimeoutError  placement groups did not become ready in time
    ├── ProtocolError          a socket message could not be decoded
    ├── HandshakeError         an engine broke the startup handshake
    ├── StartupError           a component failed or timed out while starting
    ├── ComponentDeadError     a running component died (names it, its node, the cause)
    │   ├── EngineDeadError    ... an engine core rank
    │   │   └── EngineHungError  ... one that made no progress for step_timeout_s (killed for it)
    │   ├── WorkerDeadError    ... a device worker of a rank (fails that rank)
    │   ├── CoordinatorDeadError
    │   └── ProcessDeadError   ... a local process (mp backend, API server)
    ├── WorkerError            a device worker raised (names it, carries its traceback)
    ├── RequestError           one request failed on its engine
    │   ├── MigrationRefusedError  its rank died mid-stream and its state cannot be replayed elsewhere
    │   └── KVTransferError    P/D: its decode rank gave no token within the bound after its prefill
    ├── ScaleDownError         a request outlived the drain of a rank that a scale-down removed
    └── ClusterClosedError     the cluster handle was used after ``close()``
        └── ShuttingDownError  an API server is stopping (HTTP 503 ``shutting_down``)

Errors that describe a component death carry structured fields (``rank``,
``node_id``, ``cause``) so callers can react without parsing messages.

A few subclasses live beside the code that raises them and never reach a
caller of raydp's API (each is caught where it is raised): ``ApiError`` and
``ClientGoneError`` (an HTTP handler's answer, a client that hung up),
``CoordinatorUnavailableError`` (a sequence that waited on a dead
coordinator), ``LinkClosedError`` (a device worker's channel; also a
``ConnectionError``), ``InfeasibleError`` (the planner's dead end). They
derive from :class:`RaydpError` all the same. ``raydp.cli.signals.Stop`` is
the one exception on purpose outside the tree: it is a ``KeyboardInterrupt``,
so that a stop signal unwinds like Ctrl-C through code that catches
``Exception``.
"""

from __future__ import annotations

from enum import Enum
from typing import Any


class RaydpError(Exception):
    """Base class of every error raydp raises on purpose."""


class ConfigError(RaydpError, ValueError):
    """Invalid input: the message names the field, the value given and what is allowed."""


class PlacementError(RaydpError):
    """The requested DP layout cannot be placed on the cluster's nodes."""


class PlacementTimeoutError(PlacementError):
    """Placement groups did not become ready before the timeout."""


class ProtocolError(RaydpError):
    """A message on a socket was malformed, of the wrong type, or too large."""


class HandshakeError(RaydpError):
    """An engine broke the startup handshake (unknown or duplicate rank, bad order...)."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class StartupError(RaydpError):
    """A component failed, or timed out, while starting."""


class DeathCause(str, Enum):
    """Why a component died, as far as Ray or the OS can tell."""

    KILLED = "killed"
    PROCESS_DIED = "process died"
    NODE_DIED = "node died"
    OWNER_DIED = "owner died"
    INIT_FAILED = "init failed"
    ENGINE_ERROR = "engine error"
    HUNG = "hung"
    EXITED = "exited"
    UNKNOWN = "unknown"

    @classmethod
    def of_exit(cls, exitcode: int | None) -> DeathCause:
        """A local process's cause: a negative exit code is a signal."""
        return cls.KILLED if (exitcode or 0) < 0 else cls.EXITED


class ComponentDeadError(RaydpError):
    """A running component died. ``detail`` keeps the raw cause text."""

    component: str = "component"

    def __init__(
        self,
        name: str,
        node_id: str | None,
        cause: DeathCause,
        detail: str = "",
    ) -> None:
        node = (node_id or "?")[:12]
        msg = f"{self.component} {name} on node {node} died: {cause.value}"
        if detail:
            msg += f" ({detail.strip().splitlines()[-1][:300]})"
        super().__init__(msg)
        self.name = name
        self.node_id = node_id
        self.cause = cause
        self.detail = detail


class EngineDeadError(ComponentDeadError):
    """An engine core rank died; in-flight requests on it fail with this error.

    ``restarting`` is True when the restart policy brings the rank back.
    """

    component = "engine"

    def __init__(
        self, rank: int, node_id: str | None, cause: DeathCause, detail: str = "", restarting: bool = False
    ) -> None:
        super().__init__(f"rank {rank}", node_id, cause, detail)
        if restarting:
            self.args = (f"{self.args[0]}; restarting it",)
        self.rank = rank
        self.restarting = restarting


class EngineHungError(EngineDeadError):
    """A rank held work and completed no loop turn for ``seconds_without_progress``; raydp ended it.

    ``where`` is its stuck loop thread's Python stack (innermost frame last), as
    the rank's own watchdog took it. The rank is then treated as dead: its
    streams migrate and its restart policy applies.
    """

    def __init__(
        self,
        rank: int,
        node_id: str | None,
        seconds_without_progress: float,
        where: str,
        restarting: bool = False,
    ) -> None:
        self.seconds_without_progress, self.where = seconds_without_progress, where
        super().__init__(rank, node_id, DeathCause.HUNG, self.detail_text(), restarting)
        node = (node_id or "?")[:12]
        restart = "; restarting it" if restarting else ""
        self.args = (
            f"engine rank {rank} on node {node} hung: no progress for {seconds_without_progress:.1f}s, "
            f"stuck in {_innermost_frame(where)}{restart}",
        )

    def detail_text(self) -> str:
        """``detail`` as it travels where only text goes (Ray's death reports, the mp death pipe)."""
        return f"{_HUNG_PREFIX}{self.seconds_without_progress:.3f}s\n{self.where}"

    @classmethod
    def from_detail(
        cls, rank: int, node_id: str | None, detail: str, restarting: bool = False
    ) -> EngineHungError | None:
        """The error :meth:`detail_text` described, found in ``detail`` (None when it holds none)."""
        start = detail.find(_HUNG_PREFIX)
        if start < 0:
            return None
        head, _, where = detail[start + len(_HUNG_PREFIX) :].partition("\n")
        try:
            seconds = float(head.rstrip("s"))
        except ValueError:
            return None
        return cls(rank, node_id, seconds, where.rstrip(), restarting)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.rank, self.node_id, self.seconds_without_progress, self.where, self.restarting))


_HUNG_PREFIX = "raydp-hung: no progress for "


def _innermost_frame(where: str) -> str:
    """'name (file:line)' of the last frame in a formatted stack; else its first line (a frozen rank's), or '?'."""
    lines = [line.strip() for line in where.splitlines() if line.strip().startswith("File ")]
    if not lines:
        return where.strip().splitlines()[0] if where.strip() else "?"
    # 'File "/x/y.py", line 12, in name'
    path, _, rest = lines[-1].removeprefix("File ").partition(", line ")
    line, _, name = rest.partition(", in ")
    return f"{name} ({path.strip(chr(34)).rsplit('/', 1)[-1]}:{line})"


def engine_death(
    rank: int, node_id: str | None, cause: DeathCause, detail: str = "", restarting: bool = False
) -> EngineDeadError:
    """The error a rank's death is reported with: :class:`EngineHungError` when its watchdog ended it."""
    if cause is DeathCause.HUNG:
        hung = EngineHungError.from_detail(rank, node_id, detail, restarting)
        if hung is not None:
            return hung
    return EngineDeadError(rank, node_id, cause, detail, restarting)


class WorkerDeadError(ComponentDeadError):
    """A device worker of a rank died; the rank fails with it."""

    component = "worker"

    def __init__(self, dp_rank: int, tp_rank: int, node_id: str | None, cause: DeathCause, detail: str = "") -> None:
        super().__init__(f"tp{tp_rank} of rank {dp_rank}", node_id, cause, detail)
        self.dp_rank = dp_rank
        self.tp_rank = tp_rank

    def __reduce__(self) -> tuple[Any, ...]:
        # Crosses Ray and process boundaries as the cause of a rank's death.
        return (type(self), (self.dp_rank, self.tp_rank, self.node_id, self.cause, self.detail))


class WorkerError(RaydpError):
    """A device worker raised; ``traceback`` is the worker's own traceback text."""

    def __init__(self, dp_rank: int, tp_rank: int, node_id: str | None, method: str, traceback: str) -> None:
        last = traceback.strip().splitlines()[-1] if traceback.strip() else "?"
        super().__init__(
            f"worker tp{tp_rank} of rank {dp_rank} on node {(node_id or '?')[:12]} raised in {method}: {last}"
        )
        self.dp_rank, self.tp_rank, self.node_id = dp_rank, tp_rank, node_id
        self.method, self.traceback = method, traceback

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.dp_rank, self.tp_rank, self.node_id, self.method, self.traceback))

    def __str__(self) -> str:
        return f"{self.args[0]}\n--- worker traceback ---\n{self.traceback.rstrip()}"


class CoordinatorDeadError(ComponentDeadError):
    """The coordinator actor died; ``restarting`` is True when a successor is being started."""

    component = "coordinator"

    def __init__(
        self, name: str, node_id: str | None, cause: DeathCause, detail: str = "", restarting: bool = False
    ) -> None:
        super().__init__(name, node_id, cause, detail)
        if restarting:
            self.args = (f"{self.args[0]}; restarting it",)
        self.restarting = restarting


class ProcessDeadError(ComponentDeadError):
    """A local process (mp-backend engine or API server) exited; ``restarting``: a new one is being spawned."""

    component = "process"

    def __init__(
        self,
        name: str,
        exitcode: int | None,
        node_id: str | None = None,
        restarting: bool = False,
        detail: str | None = None,
    ) -> None:
        # ``detail``: the exit in words where the code alone misleads (a child killed once its fork server died).
        super().__init__(name, node_id, DeathCause.of_exit(exitcode), detail or describe_exit(exitcode))
        if restarting:
            self.args = (f"{self.args[0]}; restarting it",)
        self.exitcode = exitcode
        self.restarting = restarting


def describe_exit(code: int | None) -> str:
    """'exit code 3', or 'exit code -9 (SIGKILL)' for a death by signal."""
    if code is not None and code < 0:
        import signal

        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exit code {code}"


class RequestError(RaydpError):
    """A request failed inside its engine; the message carries the engine's reason."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id!r} failed: {reason}")
        self.request_id = request_id
        self.reason = reason


class MigrationRefusedError(RequestError):
    """A stream's rank died mid-stream, and the stream could not go on elsewhere without changing its answer.

    ``why`` names what cannot be replayed on another rank (a grammar's state,
    a seeded generator's state); ``error`` is the rank's death.
    """

    def __init__(self, request_id: str, why: str, error: RaydpError) -> None:
        super().__init__(request_id, f"not migrated after its rank died ({error}): {why}")
        self.why, self.error = why, error

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.request_id, self.why, self.error))


class KVTransferError(RequestError):
    """P/D: a request's decode rank made no token within ``waited_s`` of its prefill's hand-off.

    The decode rank waits for the prompt's KV from the prefill rank (through
    the KV connector); this bounds that wait, so that KV that never arrives
    fails the request instead of hanging it. The request is aborted on the
    decode rank.
    """

    def __init__(self, request_id: str, rank: int, node_id: str | None, waited_s: float) -> None:
        where = f"decode rank {rank}" + (f" on node {node_id[:12]}" if node_id else "")
        super().__init__(request_id, f"{where} made no token within {waited_s:g}s of the prefill's hand-off")
        self.rank, self.node_id, self.waited_s = rank, node_id, waited_s

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.request_id, self.rank, self.node_id, self.waited_s))


class ScaleDownError(RaydpError):
    """A request was still on a rank when ``cluster.scale`` removed it (the drain timed out).

    ``rank`` is the removed rank and ``dp_size`` the size the cluster shrank to.
    """

    def __init__(self, rank: int, dp_size: int, drain_timeout_s: float | None = None) -> None:
        drain = f" within the drain timeout of {drain_timeout_s:g}s" if drain_timeout_s is not None else ""
        super().__init__(
            f"engine rank {rank} was removed by a scale-down to dp_size={dp_size} before the request finished{drain}"
        )
        self.rank, self.dp_size, self.drain_timeout_s = rank, dp_size, drain_timeout_s

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.rank, self.dp_size, self.drain_timeout_s))


class ClusterClosedError(RaydpError):
    """The cluster or client was used after ``close()``."""


class ShuttingDownError(ClusterClosedError):
    """The API server is stopping: the request was still running after its grace period, or came after it."""
