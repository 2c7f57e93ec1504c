"""RaydpConfig.create: validation messages, RAYDP_* environment, hashing."""

from __future__ import annotations

import pytest

from raydp.config import RaydpConfig
from raydp.errors import ConfigError, RaydpError


def _error(env: dict[str, str] | None = None, **fields: object) -> str:
    with pytest.raises(ConfigError) as info:
        RaydpConfig.create(env={} if env is None else env, **fields)
    return str(info.value)


def test_defaults() -> None:
    cfg = RaydpConfig.create(env={})
    assert cfg.dp_size == 1
    assert cfg.dp_size_local is None
    assert cfg.world_size == 1
    assert cfg.placement_strategy == "fill"
    assert cfg.node_allowlist is None
    assert cfg.engine_kwargs == {}


def test_config_error_is_a_value_error_and_a_raydp_error() -> None:
    with pytest.raises(ValueError):
        RaydpConfig.create(env={}, dp_size=0)
    assert issubclass(ConfigError, RaydpError)
    assert issubclass(ConfigError, ValueError)


# ---- messages name the field, the value and what is allowed ------------------------------


def test_dp_size_zero() -> None:
    msg = _error(dp_size=0)
    assert "dp_size=0" in msg
    assert "greater than or equal to 1" in msg


def test_dp_size_not_a_number() -> None:
    msg = _error(dp_size="many")
    assert "dp_size='many'" in msg
    assert "integer" in msg


def test_unknown_field() -> None:
    msg = _error(dp_sise=4)
    assert "dp_sise=4" in msg
    assert "unknown field" in msg


def test_unknown_field_names_what_is_allowed() -> None:
    assert "dp_size" in _error(dp_sise=4).replace("dp_sise", "")


def test_bad_placement_strategy() -> None:
    msg = _error(placement_strategy="pack")
    assert "placement_strategy='pack'" in msg
    for allowed in ("'strict'", "'fill'", "'span'"):
        assert allowed in msg


def test_dp_size_local_larger_than_dp_size() -> None:
    msg = _error(dp_size=2, dp_size_local=3)
    assert "dp_size_local=3" in msg
    assert "<= dp_size=2" in msg


def test_dp_size_local_equal_to_dp_size_is_fine() -> None:
    assert RaydpConfig.create(env={}, dp_size=2, dp_size_local=2).dp_size_local == 2


@pytest.mark.parametrize("name", ["Bad Name", "UPPER", "-leading-dash", "", "x" * 42, "dots.not.allowed"])
def test_bad_name_pattern(name: str) -> None:
    msg = _error(name=name)
    assert f"name={name!r}" in msg
    assert "^[a-z0-9][a-z0-9_-]{0,40}$" in msg


@pytest.mark.parametrize("name", ["raydp", "a", "team-1_prod", "0" + "x" * 40])
def test_good_names(name: str) -> None:
    assert RaydpConfig.create(env={}, name=name).name == name


def test_bad_engine_spec() -> None:
    msg = _error(engine="no_colon_here")
    assert "engine='no_colon_here'" in msg
    assert "pattern" in msg


def test_every_problem_is_reported() -> None:
    msg = _error(dp_size=0, placement_strategy="pack")
    assert "dp_size=0" in msg
    assert "placement_strategy='pack'" in msg


def test_config_is_frozen() -> None:
    cfg = RaydpConfig.create(env={})
    with pytest.raises(ValueError):
        cfg.dp_size = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    ("value", "allowed"),
    [(-0.001, "greater than or equal to 0"), (10.5, "less than or equal to 10"), ("soon", "valid number")],
)
def test_allreduce_min_interval_out_of_bounds(value: object, allowed: str) -> None:
    msg = _error(allreduce_min_interval_s=value)
    assert f"allreduce_min_interval_s={value!r}" in msg and allowed in msg


def test_allreduce_min_interval_zero_keeps_exact_step_intervals() -> None:
    assert RaydpConfig.create(env={}).allreduce_min_interval_s == 0.02
    cfg = RaydpConfig.create(env={"RAYDP_ALLREDUCE_MIN_INTERVAL_S": "0"})
    assert cfg.allreduce_min_interval_s == 0


# ---- environment --------------------------------------------------------------------------


def test_env_overrides_defaults() -> None:
    cfg = RaydpConfig.create(
        env={
            "RAYDP_DP_SIZE": "4",
            "RAYDP_LOCKSTEP": "true",
            "RAYDP_STATS_INTERVAL_S": "0.25",
            "RAYDP_PLACEMENT_STRATEGY": "span",
        }
    )
    assert cfg.dp_size == 4
    assert cfg.lockstep is True
    assert cfg.stats_interval_s == 0.25
    assert cfg.placement_strategy == "span"


def test_kwargs_win_over_env() -> None:
    cfg = RaydpConfig.create(env={"RAYDP_DP_SIZE": "4", "RAYDP_NAME": "fromenv"}, dp_size=2)
    assert cfg.dp_size == 2
    assert cfg.name == "fromenv"


def test_unrelated_env_is_ignored() -> None:
    cfg = RaydpConfig.create(env={"DP_SIZE": "9", "RAYDP_": "x", "RAY_ADDRESS": "auto"})
    assert cfg.dp_size == 1


def test_explicit_env_replaces_the_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAYDP_DP_SIZE", "7")
    assert RaydpConfig.create(env={}).dp_size == 1
    assert RaydpConfig.create().dp_size == 7


def test_bad_env_value_names_the_field() -> None:
    msg = _error(env={"RAYDP_DP_SIZE": "zero"})
    assert "dp_size='zero'" in msg


def test_node_allowlist_from_env_is_comma_separated() -> None:
    cfg = RaydpConfig.create(env={"RAYDP_NODE_ALLOWLIST": " node-a, node-b ,,node-c "})
    assert cfg.node_allowlist == ("node-a", "node-b", "node-c")


def test_node_allowlist_kwarg() -> None:
    cfg = RaydpConfig.create(env={}, node_allowlist=["n1", "n2"])
    assert cfg.node_allowlist == ("n1", "n2")


def test_engine_kwargs_from_env_json() -> None:
    cfg = RaydpConfig.create(env={"RAYDP_ENGINE_KWARGS": '{"hidden": 64, "layers": [1, 2]}'})
    assert cfg.engine_kwargs == {"hidden": 64, "layers": [1, 2]}


def test_bad_engine_kwargs_json() -> None:
    with pytest.raises(ConfigError) as info:
        RaydpConfig.create(env={"RAYDP_ENGINE_KWARGS": "{hidden: 64"})
    msg = str(info.value)
    assert "RAYDP_ENGINE_KWARGS" in msg
    assert "{hidden: 64" in msg
    assert "JSON object" in msg


def test_engine_kwargs_json_that_is_not_an_object() -> None:
    msg = _error(env={"RAYDP_ENGINE_KWARGS": "[1, 2]"})
    assert "engine_kwargs=[1, 2]" in msg
    assert "dictionary" in msg


# ---- derived values -----------------------------------------------------------------------


def test_world_size_is_tp_times_pp() -> None:
    cfg = RaydpConfig.create(env={}, tensor_parallel_size=4, pipeline_parallel_size=2)
    assert cfg.world_size == 8


def test_config_hash_equal_for_equal_configs() -> None:
    a = RaydpConfig.create(env={}, dp_size=4, engine_kwargs={"a": 1, "b": 2})
    b = RaydpConfig.create(env={"RAYDP_DP_SIZE": "4"}, engine_kwargs={"b": 2, "a": 1})
    assert a.config_hash() == b.config_hash()
    assert len(a.config_hash()) == 16


@pytest.mark.parametrize(
    "change",
    [
        {"dp_size": 3},
        {"tensor_parallel_size": 2},
        {"lockstep": True},
        {"allreduce_interval": 8},
        {"engine_kwargs": {"a": 2}},
        {"name": "other"},
    ],
)
def test_config_hash_differs_when_a_shared_field_differs(change: dict[str, object]) -> None:
    base = {"dp_size": 4, "engine_kwargs": {"a": 1}}
    a = RaydpConfig.create(env={}, **base)
    b = RaydpConfig.create(env={}, **{**base, **change})
    assert a.config_hash() != b.config_hash()


def test_empty_allowlist_env_means_unset() -> None:
    cfg = RaydpConfig.create(env={"RAYDP_NODE_ALLOWLIST": " , "})
    assert cfg.node_allowlist is None


@pytest.mark.parametrize(
    ("fields", "curve"),
    [({}, True), ({"transport": "tcp"}, True), ({"transport": "ipc"}, False), ({"auth": "none"}, False)],
)
def test_curve_guards_every_cluster_reachable_over_tcp(fields: dict[str, str], curve: bool) -> None:
    assert RaydpConfig(**fields).uses_curve is curve


def test_bad_auth_names_what_is_allowed() -> None:
    with pytest.raises(ConfigError, match=r"auth='tls'.*'curve'.*'none'"):
        RaydpConfig.create(env={"RAYDP_AUTH": "tls"})


def test_p_d_pools_size_the_cluster_and_refuse_what_they_cannot_run() -> None:
    config = RaydpConfig(prefill_dp_size=1, decode_dp_size=2)
    assert (config.dp_size, config.pooled) == (3, True)
    assert RaydpConfig(prefill_dp_size=1, decode_dp_size=2, dp_size=3).dp_size == 3
    with pytest.raises(ConfigError, match=r"dp_size=2: a P/D cluster's size is prefill_dp_size \+ decode_dp_size = 3"):
        RaydpConfig(prefill_dp_size=1, decode_dp_size=2, dp_size=2)
    with pytest.raises(ConfigError, match="prefill_dp_size=0, decode_dp_size=2: a P/D cluster needs"):
        RaydpConfig(decode_dp_size=2)
    with pytest.raises(ConfigError, match="lockstep=True: P/D pools run dense ranks only"):
        RaydpConfig(prefill_dp_size=1, decode_dp_size=1, lockstep=True)
    with pytest.raises(ConfigError, match="prefill_dp_size=-1"):
        RaydpConfig(prefill_dp_size=-1, decode_dp_size=1)
    assert RaydpConfig.create({"RAYDP_PREFILL_DP_SIZE": "2", "RAYDP_DECODE_DP_SIZE": "2"}).dp_size == 4
