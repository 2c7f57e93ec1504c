"""Turn what Ray says about a finished ref into a typed death cause."""

from __future__ import annotations

import ray
from ray.exceptions import RayActorError, RayTaskError

from raydp.errors import DeathCause, EngineHungError, WorkerDeadError

_MARKERS: tuple[tuple[str, DeathCause], ...] = (
    ("ray.kill", DeathCause.KILLED),
    ("killed", DeathCause.KILLED),
    ("node", DeathCause.NODE_DIED),
    ("owner", DeathCause.OWNER_DIED),
    ("worker process", DeathCause.PROCESS_DIED),
    ("exit", DeathCause.PROCESS_DIED),
)


def cause_from_message(message: str) -> DeathCause:
    """Classify Ray's death message; the first matching marker wins."""
    text = message.lower()
    for marker, cause in _MARKERS:
        if marker in text and (cause is not DeathCause.NODE_DIED or _node_died(text)):
            return cause
    return DeathCause.UNKNOWN


def _node_died(text: str) -> bool:
    return any(w in text for w in ("node died", "node has died", "node is dead", "node was dead", "raylet"))


def death_of(ref: ray.ObjectRef) -> tuple[DeathCause, str] | None:  # type: ignore[type-arg]
    """The cause and detail of a finished ``run()`` ref; None if it returned cleanly."""
    try:
        ray.get(ref, timeout=5)
    except RayActorError as exc:
        if getattr(exc, "actor_init_failed", False):
            return DeathCause.INIT_FAILED, str(exc)
        return cause_from_message(str(exc)), str(exc)
    except RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, WorkerDeadError):  # a worker's death ended the rank: report the worker's cause
            return cause.cause, str(cause)
        if isinstance(cause, EngineHungError):  # its watchdog ended it: the detail carries the stuck stack
            return DeathCause.HUNG, cause.detail
        return DeathCause.ENGINE_ERROR, str(exc)
    except Exception as exc:  # anything else Ray may raise for a lost ref
        return DeathCause.UNKNOWN, repr(exc)
    return None
