"""The autoscaling policy as a pure function of load readings: bounds, delays, no flapping."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from raydp.config import AutoscalingConfig, RaydpConfig
from raydp.errors import ConfigError
from raydp.orchestration.autoscaling import AutoscalePolicy

pytestmark = pytest.mark.timeout(120)

configs = st.builds(
    lambda low, span, target, up, down, look: AutoscalingConfig(
        min_dp_size=low,
        max_dp_size=low + span,
        target_ongoing_requests=target,
        upscale_delay_s=up,
        downscale_delay_s=down,
        look_back_s=look,
    ),
    st.integers(1, 4),
    st.integers(0, 5),
    st.sampled_from([0.5, 1.0, 2.0, 8.0]),
    st.sampled_from([0.0, 1.0, 5.0, 30.0]),
    st.sampled_from([0.0, 2.0, 10.0, 600.0]),
    st.sampled_from([1.0, 5.0, 30.0]),
)
readings = st.lists(st.tuples(st.sampled_from([0.1, 0.5, 1.0, 3.0]), st.integers(0, 60)), min_size=1, max_size=120)


@settings(max_examples=300, deadline=None)
@given(config=configs, trace=readings, start=st.integers(1, 9))
def test_the_size_stays_in_bounds_and_never_changes_inside_its_delay(
    config: AutoscalingConfig, trace: list[tuple[float, int]], start: int
) -> None:
    policy = AutoscalePolicy(config)
    now, current = 0.0, start
    history: list[tuple[float, int, int]] = []  # (time, size then, what the load asked for then)
    for dt, ongoing in trace:
        now += dt
        policy.observe(now, ongoing)
        raw = policy.raw(current).size
        history.append((now, current, raw))
        want = policy.decide(now, current)
        if want is None:
            continue
        assert config.min_dp_size <= want.size <= config.max_dp_size
        assert want.size != current
        if config.min_dp_size <= current <= config.max_dp_size:
            up = want.size > current
            delay = config.upscale_delay_s if up else config.downscale_delay_s
            # Every reading at this size within the delay wanted the same direction, and the wish
            # is at least `delay` old: no change happens inside its delay.
            streak = [h for h in history if h[1] == current and h[0] >= now - delay]
            assert all((raw > size) == up and raw != size for _, size, raw in streak), (want, streak)
            first = max(
                (t for t, size, raw in history if size != current or (raw > size) != up or raw == size), default=None
            )
            assert first is None or now - first >= delay or delay == 0, (first, now, delay)
        current = want.size
    assert config.min_dp_size <= current <= config.max_dp_size or current == start


def test_serves_defaults_and_a_steady_load_are_followed_after_the_delays() -> None:
    config = AutoscalingConfig(max_dp_size=4)
    assert (config.min_dp_size, config.target_ongoing_requests, config.upscale_delay_s) == (1, 2.0, 30.0)
    assert (config.downscale_delay_s, config.look_back_s) == (600.0, 30.0)
    policy = AutoscalePolicy(config)
    t = 0.0
    for _ in range(30):  # the wish is first seen at t=1: it has held for 30 s at t=31
        t += 1.0
        policy.observe(t, 7)  # 7 ongoing, 2 per rank: 4 ranks wanted
        assert policy.decide(t, 1) is None, "not before the upscale delay"
    t += 1.0
    policy.observe(t, 7)
    want = policy.decide(t, 1)
    assert want is not None and want.size == 4 and "7.0 ongoing requests" in want.reason
    decided_at = None
    while t < 31 + 600 + 60 and decided_at is None:
        t += 1.0
        policy.observe(t, 0)
        want = policy.decide(t, 4)
        if want is not None:
            assert want.size == 1
            decided_at = t
    # Not before the downscale delay, and once the window has forgotten the load, not much later.
    assert decided_at is not None and 31 + 600 <= decided_at <= 31 + 600 + 31


def test_a_break_in_the_wish_restarts_the_delay() -> None:
    policy = AutoscalePolicy(AutoscalingConfig(max_dp_size=3, upscale_delay_s=5, look_back_s=0.5))
    for t in range(1, 5):
        policy.observe(t, 6)
        assert policy.decide(t, 1) is None
    policy.observe(5, 0)  # the window has only this reading: no more ranks wanted
    assert policy.decide(5, 1) is None
    for t in range(6, 11):
        policy.observe(t, 6)
        assert policy.decide(t, 1) is None
    policy.observe(11, 6)
    want = policy.decide(11, 1)
    assert want is not None and want.size == 3


def test_bad_autoscaling_configs_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"min_dp_size=3 must be <= max_dp_size=2"):
        AutoscalingConfig(min_dp_size=3, max_dp_size=2)
    with pytest.raises(ConfigError, match=r"autoscale='4': must be MIN:MAX"):
        AutoscalingConfig.parse("4")
    with pytest.raises(ConfigError, match=r"dp_size=5 must be within autoscaling's \[1, 4\]"):
        RaydpConfig(dp_size=5, autoscaling={"max_dp_size": 4})
    assert AutoscalingConfig.parse("2:6").max_dp_size == 6
    assert RaydpConfig.create(env={"RAYDP_AUTOSCALING": '{"max_dp_size": 3}'}).autoscaling is not None
