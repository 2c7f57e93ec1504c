"""Telling whoever listens that a component died (both backends and the API servers)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from raydp.errors import ComponentDeadError

DeathListener = Callable[[ComponentDeadError], None]
logger = logging.getLogger("raydp.deaths")


def notify(listeners: Sequence[DeathListener], err: ComponentDeadError) -> None:
    """Log a death and tell every listener; one failing listener does not silence the others."""
    logger.error("%s", err)
    for listener in list(listeners):
        try:
            listener(err)
        except Exception:
            logger.exception("death listener failed")
