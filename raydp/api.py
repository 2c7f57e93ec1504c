"""``launch`` and ``attach``: the public way to get a running cluster handle."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from raydp.actors.connection import connect, local_resources
from raydp.backend import Backend
from raydp.cluster import Cluster
from raydp.config import RaydpConfig
from raydp.engine.core import check_engine_class, engine_path, load_engine_class
from raydp.errors import ConfigError


def launch(
    config: RaydpConfig | None = None,
    *,
    engine: str | type | None = None,
    placement_groups: Sequence[Any] | None = None,
    address: str | None = None,
    progress: bool | None = None,
    backend: str = "ray",
    **fields: Any,
) -> Cluster:
    """Start a DP cluster and return its handle.

    Either pass a :class:`RaydpConfig`, or its fields as keywords (validated,
    with ``RAYDP_*`` environment overrides). ``engine`` is an engine core class
    or ``'module:Class'`` path; ``placement_groups`` are user-made groups, one
    per rank, used instead of planning. ``backend="ray"`` (the default) joins
    the Ray cluster at ``address`` (or the ambient one, or starts a local
    one); ``backend="mp"`` runs the ranks as local processes without Ray.
    """
    if backend not in ("ray", "mp"):
        raise ConfigError(f"backend={backend!r}: must be 'ray' or 'mp'")
    if backend == "mp" and placement_groups is not None:
        raise ConfigError("placement_groups: only the 'ray' backend uses placement groups")
    config = _resolve_config(config, engine, fields)
    engine_cls = engine if isinstance(engine, type) else None
    if engine_cls is not None:
        check_engine_class(engine_cls, config.engine)
        if backend == "mp":
            load_engine_class(config.engine)  # spawned processes import it by path: it must be importable
    _check_engine_kwargs(config, engine_cls)
    bar = _progress_bar(progress, config)
    manager: Backend
    node_id: str | None = None  # the mp backend's endpoints name no node of Ray's
    if backend == "mp":
        from raydp.local import ProcessManager

        manager = ProcessManager(config, progress=bar)
    else:
        connect(address, local=local_resources(config))
        if config.detached:
            return _launch_supervised(config, engine_cls, placement_groups)
        from raydp.actors.manager import ActorManager

        ray_manager = ActorManager(config, placement_groups=placement_groups, progress=bar, engine_cls=engine_cls)
        manager, node_id = ray_manager, ray_manager.driver_node_id
    endpoints = manager.start()
    try:
        return Cluster(manager, endpoints, node_id=node_id)
    except BaseException:
        manager.close()
        raise


def _launch_supervised(config: RaydpConfig, engine_cls: type | None, placement_groups: Sequence[Any] | None) -> Cluster:
    """A detached cluster is supervised from inside itself (:mod:`raydp.actors.supervisor`): it heals
    and scales without this process, and this handle is attached to it like any other."""
    from raydp.actors.connection import this_node_id
    from raydp.actors.supervisor import SupervisedBackend

    backend = SupervisedBackend.launch(config, engine_cls, placement_groups, this_node_id())
    return Cluster(
        backend, backend.endpoints, node_id=backend.node_id, follow_liveness=True, terminate=backend.terminate
    )


def _check_engine_kwargs(config: RaydpConfig, engine_cls: type | None) -> None:
    """An engine class may check its ``engine_kwargs`` before anything starts (``check_engine_kwargs``).

    A class that does not import here (it may exist only where the ranks run) is left to its ranks.
    """
    if engine_cls is None:
        try:
            engine_cls = load_engine_class(config.engine)  # type: ignore[assignment]
        except ConfigError:
            return
    check = getattr(engine_cls, "check_engine_kwargs", None)
    if check is not None:
        check(config)


def _resolve_config(config: RaydpConfig | None, engine: str | type | None, fields: dict[str, Any]) -> RaydpConfig:
    if config is not None and fields:
        raise ConfigError(f"pass either config or fields, not both (got fields {sorted(fields)})")
    if engine is not None:
        fields["engine"] = engine_path(engine)
    if config is None:
        return RaydpConfig.create(**fields)
    return config.with_changes(**fields) if fields else config


def attach(name: str, *, address: str | None = None) -> Cluster:
    """A handle to a cluster launched elsewhere (e.g. ``detached=True``) by its name.

    ``close()`` on it closes only its clients, never the cluster's actors;
    ``shutdown()`` ends the cluster. Raises ConfigError if no cluster of
    that name is running (or it is still starting).
    """
    connect(address)
    from raydp.actors.attached import AttachedBackend

    backend = AttachedBackend.find(name)
    return Cluster(
        backend, backend.endpoints, node_id=backend.node_id, follow_liveness=True, terminate=backend.terminate
    )


def _progress_bar(enabled: bool | None, config: RaydpConfig) -> Any:
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    from tqdm import tqdm

    bar = tqdm(total=config.dp_size, desc=f"{config.name}: ranks ready", unit="rank", leave=False)

    def update(done: int, total: int) -> None:
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return update
