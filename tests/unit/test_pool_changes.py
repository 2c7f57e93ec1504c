"""Resizing a P/D cluster's pools over the in-memory runtime: the plan, the order of the steps, the autoscalers."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raydp.config import AutoscalingConfig, RaydpConfig
from raydp.coordinator.state import CoordinatorState
from raydp.errors import ConfigError, StartupError
from raydp.orchestration.autoscaling import Autoscaler
from raydp.orchestration.core import Orchestrator
from raydp.orchestration.pools import plan
from raydp.wire.control import EngineStats, ScaleEngines, coordinator_decoder
from raydp.wire.endpoints import ClusterEndpoints
from tests.unit.orchestration_model import ModelCoordinator, ModelRuntime, started

pytestmark = pytest.mark.timeout(60)


def _pooled(prefill: int, decode: int, **fields: object) -> tuple[Orchestrator, ModelRuntime, CoordinatorState]:
    coord = CoordinatorState(engine_count=prefill + decode, stats_interval_s=0.125, heartbeat_interval_s=1.0)
    runtime = ModelRuntime(lambda: coord)
    control = ModelCoordinator(lambda body: coord.handle(coordinator_decoder(body)))
    o = started(prefill + decode, runtime, control, prefill_dp_size=prefill, decode_dp_size=decode, **fields)
    runtime.published.clear()
    return o, runtime, coord


def _views(o: Orchestrator) -> list[tuple[int, int]]:
    """Filled with (prefill ranks, decode ranks routed to) at each step a client of this process is told."""
    views: list[tuple[int, int]] = []
    o.controls.scale_listeners.append(lambda e, size, _: views.append((e.prefill_ranks, size - e.prefill_ranks)))
    return views


def _pools(endpoints: ClusterEndpoints, size: int | None = None) -> tuple[int, int]:
    """(prefill ranks, decode ranks) that clients route to by these endpoints."""
    n = len(endpoints.engines) if size is None else size
    return endpoints.prefill_ranks, n - endpoints.prefill_ranks


# ---- the plan -------------------------------------------------------------------------


def test_each_pool_resizes_and_the_other_keeps_its_size() -> None:
    assert plan(0, 3, None, 5) == plan(0, 9, None, 5)  # an unpooled cluster: the size is the size
    assert (plan(2, 5, "decode", 1).dp_size, plan(2, 5, "decode", 1).prefill) == (3, 2)
    assert (plan(2, 5, "prefill", 4).dp_size, plan(2, 5, "prefill", 4).prefill) == (7, 4)
    assert (plan(2, 5, "prefill", 1).dp_size, plan(2, 5, "prefill", 1).prefill) == (4, 1)


@given(st.integers(1, 8), st.integers(1, 8), st.sampled_from(["prefill", "decode"]), st.integers(1, 8))
def test_a_pool_change_never_touches_the_other_pool(prefill: int, decode: int, pool: str, size: int) -> None:
    target = plan(prefill, prefill + decode, pool, size)
    sizes = {"prefill": target.prefill, "decode": target.dp_size - target.prefill}
    assert sizes[pool] == size
    assert sizes["decode" if pool == "prefill" else "prefill"] == (decode if pool == "prefill" else prefill)


def test_a_pool_that_does_not_exist_or_would_be_empty_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="pool='decode': this cluster has no P/D pools; leave pool out"):
        plan(0, 3, "decode", 2)
    with pytest.raises(ConfigError, match="pool=None: a P/D cluster scales one pool at a time; allowed: 'prefill'"):
        plan(2, 4, None, 3)
    with pytest.raises(ConfigError, match="pool='both'"):
        plan(2, 4, "both", 3)
    with pytest.raises(ConfigError, match="dp_size=0: the prefill pool needs at least 1 rank"):
        plan(2, 4, "prefill", 0)


def test_prefill_autoscaling_needs_pools_and_starts_within_its_bounds() -> None:
    bounds = {"min_dp_size": 1, "max_dp_size": 3}
    assert RaydpConfig(prefill_dp_size=2, decode_dp_size=1, prefill_autoscaling=bounds).prefill_autoscaling == (
        AutoscalingConfig(**bounds)
    )
    with pytest.raises(ConfigError, match="prefill_autoscaling: only a P/D cluster"):
        RaydpConfig(dp_size=2, prefill_autoscaling=bounds)
    with pytest.raises(ConfigError, match=r"prefill_dp_size=4 must be within prefill_autoscaling's \[1, 3\]"):
        RaydpConfig(prefill_dp_size=4, decode_dp_size=1, prefill_autoscaling=bounds)


def test_the_prefill_pool_may_shard_over_its_own_number_of_devices_and_then_keeps_its_ranks() -> None:
    config = RaydpConfig(prefill_dp_size=2, decode_dp_size=1, prefill_tensor_parallel_size=4, tensor_parallel_size=2)
    assert [config.world_size_of(r) for r in range(4)] == [4, 4, 2, 2], "a rank added by a scale-up decodes"
    assert RaydpConfig(prefill_dp_size=1, decode_dp_size=1, prefill_tensor_parallel_size=1).pools_differ is False
    with pytest.raises(ConfigError, match="prefill_tensor_parallel_size=2: only a P/D cluster"):
        RaydpConfig(dp_size=2, prefill_tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="prefill_autoscaling with prefill_tensor_parallel_size=2 != tensor_paral"):
        RaydpConfig(
            prefill_dp_size=1,
            decode_dp_size=1,
            prefill_tensor_parallel_size=2,
            prefill_autoscaling={"min_dp_size": 1, "max_dp_size": 2},
        )
    o, _, _ = _pooled(1, 1, prefill_tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="pool='prefill': the prefill pool grows and shrinks by trading ranks"):
        o.scale(2, 0.0, "prefill")
    assert o.endpoints is not None and _pools(o.scale(2, 0.0, "decode")) == (1, 2)


# ---- the steps ------------------------------------------------------------------------


def test_a_growing_prefill_pool_moves_the_boundary_after_the_new_ranks_joined() -> None:
    o, runtime, coord = _pooled(2, 2)
    views = _views(o)
    endpoints = o.scale(3, 1.0, "prefill")
    assert _pools(endpoints) == (3, 2) and len(o.table) == 5 and runtime.alive == set(range(5))
    assert views == [(2, 3), (3, 2)], "the new rank joined as a decode rank, then rank 2 moved to the prefill pool"
    assert coord.prefill_ranks == 3, "the coordinator's snapshots carry the boundary to other processes' clients"
    assert (coord.engine_count, coord.size) == (5, 5)


def test_a_shrinking_prefill_pool_moves_the_boundary_before_the_highest_ranks_drain() -> None:
    o, runtime, coord = _pooled(3, 2)
    views = _views(o)
    endpoints = o.scale(1, 0.0, "prefill")
    assert _pools(endpoints) == (1, 2) and len(o.table) == 3 and runtime.alive == {0, 1, 2}
    assert views == [(1, 4), (1, 2), (1, 2)], (
        "ranks 1 and 2 decode before ranks 3 and 4 stop taking work; the decode pool never falls below 2"
    )
    assert coord.prefill_ranks == 1 and (coord.engine_count, coord.size) == (3, 3)


def test_the_decode_pool_resizes_at_the_top_and_the_boundary_stays() -> None:
    o, runtime, coord = _pooled(2, 1)
    assert _pools(o.scale(3, 1.0, "decode")) == (2, 3)
    assert _pools(o.scale(1, 0.0, "decode")) == (2, 1)
    assert all(e.prefill_ranks == 2 for e in runtime.published) and coord.prefill_ranks == -1
    o.state.check()


def test_a_failed_prefill_scale_up_leaves_both_pools_as_they_were() -> None:
    o, runtime, coord = _pooled(1, 1)
    runtime.wedged_starts = 1
    with pytest.raises(Exception, match="did not start"):
        o.scale(2, 1.0, "prefill")
    assert o.endpoints is not None and _pools(o.endpoints) == (1, 1) and len(o.table) == 2
    assert coord.prefill_ranks == -1 and runtime.alive == {0, 1}


def test_a_prefill_scale_up_whose_boundary_never_moves_gives_its_new_ranks_back() -> None:
    """The new rank joined (as a decode rank); the boundary's move reaches the coordinator only after the
    launcher gave up on it: the change fails, and the cluster is as it was, not a decode rank bigger than
    anyone asked for, nor a coordinator whose pools have no decode rank."""
    coord = CoordinatorState(engine_count=2, stats_interval_s=0.125, heartbeat_interval_s=1.0)
    late: list[ScaleEngines] = []

    def deliver(body: bytes) -> None:
        msg = coordinator_decoder(body)
        if isinstance(msg, ScaleEngines) and msg.prefill > 1:
            late.append(msg)  # the move to 2 prefill ranks is held up...
            return
        for held in late:  # ...and arrives just before whatever the launcher sends next
            coord.handle(held)
        late.clear()
        coord.handle(msg)

    runtime = ModelRuntime(lambda: coord)
    o = started(2, runtime, ModelCoordinator(deliver), prefill_dp_size=1, decode_dp_size=1, handshake_timeout_s=0.5)
    views = _views(o)
    with pytest.raises(StartupError, match="waiting for the coordinator to move the pools to 2"):
        o.scale(2, 0.5, "prefill")
    assert o.endpoints is not None and _pools(o.endpoints) == (1, 1) and len(o.table) == 2
    assert runtime.alive == {0, 1} and (coord.engine_count, coord.size) == (2, 2)
    assert coord.prefill_ranks == 1, "the old boundary followed the late move"
    assert views[0] == (1, 2) and views[-1] == (1, 1), "the new rank served as a decode rank, then went"


@settings(max_examples=25, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 3),
    st.lists(st.tuples(st.sampled_from(["prefill", "decode"]), st.integers(1, 4)), min_size=1, max_size=4),
)
def test_any_sequence_of_pool_changes_keeps_both_pools_served_at_every_step(
    prefill: int, decode: int, changes: list[tuple[str, int]]
) -> None:
    o, runtime, coord = _pooled(prefill, decode, stats_interval_s=0.001)
    views = _views(o)
    for pool, size in changes:
        before = {"prefill": prefill, "decode": decode}
        views.clear()
        endpoints = o.scale(size, 0.0, pool)
        prefill, decode = _pools(endpoints)
        assert {"prefill": prefill, "decode": decode}[pool] == size
        assert (prefill, decode) == ((size, before["decode"]) if pool == "prefill" else (before["prefill"], size))
        for p, d in views:  # every view a client was given on the way: the ranks it may send to, by pool
            assert p >= min(before["prefill"], prefill) and d >= min(before["decode"], decode), (pool, size, p, d)
        o.state.check()
        assert runtime.alive == set(range(prefill + decode)) and len(o.table) == prefill + decode
        assert coord.prefill_ranks in (-1, prefill) and (coord.engine_count, coord.size) == (prefill + decode,) * 2


# ---- the autoscalers ------------------------------------------------------------------


def _autoscaler(o: Orchestrator, pool: str, high: int) -> Autoscaler:
    config = AutoscalingConfig(
        min_dp_size=1, max_dp_size=high, target_ongoing_requests=2, upscale_delay_s=0, downscale_delay_s=0
    )
    return Autoscaler(o.controls, functools.partial(o.scale, wait=True), config, pool)


def test_each_pool_is_autoscaled_by_its_own_ranks_load() -> None:
    o, runtime, coord = _pooled(1, 1)
    prefill, decode = _autoscaler(o, "prefill", 3), _autoscaler(o, "decode", 3)
    coord.handle(EngineStats(rank=0, waiting=5, running=1))  # 6 prefills waiting or running: 3 ranks' worth
    coord.handle(EngineStats(rank=1, waiting=0, running=1))  # one stream decoding: 1 rank is enough
    decode.step(0.0)
    assert o.endpoints is not None and _pools(o.endpoints) == (1, 1), "the decode pool's own load wants no change"
    prefill.step(0.0)
    assert _pools(o.endpoints) == (3, 1)
    assert [(d.pool, d.current, d.desired) for d in runtime.decisions] == [
        ("decode", 1, 1),
        ("prefill", 1, 3),
        ("prefill", 3, 3),
    ]
    coord.handle(EngineStats(rank=3, waiting=2, running=6))  # the decode rank (rank 3 now) gets busy
    decode.step(1.0)
    assert _pools(o.endpoints) == (3, 3), "the decode pool grew at the top; the prefill pool kept its 3 ranks"
    o.state.check()
