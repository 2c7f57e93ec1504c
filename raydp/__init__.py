"""raydp: data-parallel engine cores on Ray.

Start a cluster with :func:`launch`, join one with :func:`attach`, send work
with ``cluster.client()``. Every error raydp raises derives from
:class:`RaydpError` (see :mod:`raydp.errors`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from raydp.config import AutoscalingConfig, RaydpConfig
from raydp.errors import (
    ClusterClosedError,
    ComponentDeadError,
    ConfigError,
    CoordinatorDeadError,
    DeathCause,
    EngineDeadError,
    EngineHungError,
    HandshakeError,
    KVTransferError,
    MigrationRefusedError,
    PlacementError,
    PlacementTimeoutError,
    ProcessDeadError,
    ProtocolError,
    RaydpError,
    RequestError,
    ScaleDownError,
    ShuttingDownError,
    StartupError,
    WorkerDeadError,
    WorkerError,
)

if TYPE_CHECKING:
    from raydp.api import attach, launch
    from raydp.client.aio import AsyncClient
    from raydp.client.client import Client
    from raydp.cluster import Cluster
    from raydp.engine.core import EngineContext, EngineCore
    from raydp.models.echo import EchoEngine
    from raydp.wire.sampling import Sampling

__all__ = [
    "AsyncClient",
    "AutoscalingConfig",
    "Client",
    "Cluster",
    "ClusterClosedError",
    "ComponentDeadError",
    "ConfigError",
    "CoordinatorDeadError",
    "DeathCause",
    "EchoEngine",
    "EngineContext",
    "EngineCore",
    "EngineDeadError",
    "EngineHungError",
    "HandshakeError",
    "KVTransferError",
    "MigrationRefusedError",
    "PlacementError",
    "PlacementTimeoutError",
    "ProcessDeadError",
    "ProtocolError",
    "RaydpConfig",
    "RaydpError",
    "RequestError",
    "Sampling",
    "ScaleDownError",
    "ShuttingDownError",
    "StartupError",
    "WorkerDeadError",
    "WorkerError",
    "attach",
    "launch",
]

# Ray and torch are heavy: import the modules that need them on first use.
_LAZY = {
    "AsyncClient": "raydp.client.aio",
    "Client": "raydp.client.client",
    "Cluster": "raydp.cluster",
    "attach": "raydp.api",
    "launch": "raydp.api",
    "EchoEngine": "raydp.models.echo",
    "EngineContext": "raydp.engine.core",
    "EngineCore": "raydp.engine.core",
    "Sampling": "raydp.wire.sampling",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'raydp' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
