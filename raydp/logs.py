"""Logging setup for raydp components: every line carries who wrote it."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s %(levelname)s [%(component)s] %(name)s: %(message)s"


class _ComponentFilter(logging.Filter):
    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def filter(self, record: logging.LogRecord) -> bool:
        record.component = self.component
        return True


def configure_component_logging(component: str) -> None:
    """Prefix raydp's log lines in this process with ``component`` (e.g. 'dp3 lr1 node ab12')."""
    logger = logging.getLogger("raydp")
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ComponentFilter(component))
    handler.setFormatter(logging.Formatter(_FORMAT))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("RAYDP_LOG_LEVEL", "INFO"))
    logger.propagate = False
