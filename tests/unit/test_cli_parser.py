"""Every command-line flag is documented."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from raydp.cli import build_parser
from raydp.errors import ConfigError


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_the_commands_exist() -> None:
    assert set(subcommands()) == {"demo", "serve", "plan", "status", "scale", "make-model", "dashboard"}


@pytest.mark.parametrize("command", ["demo", "serve", "plan", "status", "scale", "dashboard"])
def test_every_flag_has_help(command: str) -> None:
    parser = subcommands()[command]
    undocumented = [a.option_strings for a in parser._actions if a.option_strings and not (a.help and a.help.strip())]
    assert undocumented == []
    assert parser.description


def test_bad_flag_value_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["demo", "--dp-size", "two"])
    assert exit_info.value.code == 2
    assert "--dp-size" in capsys.readouterr().err


def parsed(command: str, *flags: str) -> argparse.Namespace:
    return build_parser().parse_args([command, *flags])


@pytest.mark.parametrize("command", ["demo", "serve", "plan"])
def test_an_unset_flag_leaves_the_field_to_the_environment(command: str) -> None:
    from raydp.cli import demo, plan, serve
    from raydp.cli.options import config_from_args

    module = {"demo": demo, "serve": serve, "plan": plan}[command]
    presets = getattr(module, "PRESETS", {})
    args = parsed(command)
    assert not hasattr(args, "dp_size")  # argparse holds no default that could override the variable
    assert config_from_args(args, module.CONFIG_FLAGS, presets, env={"RAYDP_DP_SIZE": "3"}).dp_size == 3
    flagged = parsed(command, "--dp-size", "2")
    assert config_from_args(flagged, module.CONFIG_FLAGS, presets, env={"RAYDP_DP_SIZE": "3"}).dp_size == 2


def test_precedence_is_flag_then_environment_then_preset_then_field_default() -> None:
    from raydp.cli import demo
    from raydp.cli.options import config_from_args

    def cfg(*flags: str, env: dict[str, str] | None = None) -> object:
        return config_from_args(parsed("demo", *flags), demo.CONFIG_FLAGS, demo.PRESETS, env=env or {})

    assert cfg().dp_size == 2  # the demo's preset
    assert cfg().max_restarts == 0  # the field's default
    assert cfg(env={"RAYDP_MAX_RESTARTS": "4"}).max_restarts == 4
    assert cfg("--max-restarts", "1", env={"RAYDP_MAX_RESTARTS": "4"}).max_restarts == 1
    assert cfg("--lockstep").lockstep is True
    assert cfg("--no-lockstep", env={"RAYDP_LOCKSTEP": "true"}).lockstep is False


def test_engine_short_names_resolve_from_flag_and_environment() -> None:
    from raydp.cli import serve
    from raydp.cli.options import config_from_args

    args = parsed("serve")
    assert config_from_args(args, serve.CONFIG_FLAGS, serve.PRESETS, env={}).engine.endswith("TinyLMEngine")
    env = {"RAYDP_ENGINE": "echo"}
    assert config_from_args(args, serve.CONFIG_FLAGS, serve.PRESETS, env=env).engine == "raydp.models.echo:EchoEngine"


def test_aliases_and_repeated_flags_reach_the_config() -> None:
    from raydp.cli import plan
    from raydp.cli.options import config_from_args

    args = parsed("plan", "--strategy", "strict", "--allow", "aaaa", "--allow", "bbbb", "--master", "cccc")
    cfg = config_from_args(args, plan.CONFIG_FLAGS, {}, env={})
    assert (cfg.placement_strategy, cfg.node_allowlist, cfg.master_node_id) == ("strict", ("aaaa", "bbbb"), "cccc")


def test_a_bad_environment_value_names_the_field() -> None:
    from raydp.cli import demo
    from raydp.cli.options import config_from_args
    from raydp.errors import ConfigError

    with pytest.raises(ConfigError, match="dp_size='zero'"):
        config_from_args(parsed("demo"), demo.CONFIG_FLAGS, demo.PRESETS, env={"RAYDP_DP_SIZE": "zero"})


@pytest.mark.timeout(10)
def test_p_d_flags_size_the_cluster_over_the_commands_preset_dp_size() -> None:
    from raydp.cli import serve
    from raydp.cli.options import add_config_flags, config_from_args

    parser = argparse.ArgumentParser()
    add_config_flags(parser, serve.CONFIG_FLAGS, serve.PRESETS)
    args = parser.parse_args(["--prefill-dp-size", "2", "--decode-dp-size", "3"])
    config = config_from_args(args, serve.CONFIG_FLAGS, serve.PRESETS, env={})
    assert (config.dp_size, config.prefill_dp_size, config.decode_dp_size) == (5, 2, 3)


def test_each_p_d_pool_autoscales_within_its_own_bounds_from_the_serve_flags() -> None:
    from raydp.cli import serve
    from raydp.cli.options import autoscaled, config_from_args

    flags = ["serve", "--prefill-dp-size", "1", "--decode-dp-size", "5", "--prefill-autoscale", "2:3"]
    args = parsed(*flags, "--autoscale", "1:4")
    config = autoscaled(config_from_args(args, serve.CONFIG_FLAGS, serve.PRESETS, env={}), args)
    assert (config.prefill_dp_size, config.decode_dp_size, config.dp_size) == (2, 4, 6), "each starts in bounds"
    assert config.prefill_autoscaling is not None and config.prefill_autoscaling.max_dp_size == 3
    assert config.autoscaling is not None and config.autoscaling.max_dp_size == 4
    args = parsed("serve", "--dp-size", "2", "--prefill-autoscale", "1:2")
    with pytest.raises(ConfigError, match="--prefill-autoscale=1:2: only a P/D cluster has a prefill pool"):
        autoscaled(config_from_args(args, serve.CONFIG_FLAGS, serve.PRESETS, env={}), args)


def test_the_preset_engine_shards_over_devices_when_tensor_parallel_size_is_above_one() -> None:
    from raydp.cli import demo
    from raydp.cli.options import add_config_flags, config_from_args

    parser = argparse.ArgumentParser()
    add_config_flags(parser, demo.CONFIG_FLAGS, demo.PRESETS)
    tp2 = config_from_args(parser.parse_args(["--tensor-parallel-size", "2"]), demo.CONFIG_FLAGS, demo.PRESETS, env={})
    assert tp2.engine == "raydp.models.tp_lm:TPLMEngine" and tp2.world_size == 2
    env = {"RAYDP_TENSOR_PARALLEL_SIZE": "2"}
    assert config_from_args(parser.parse_args([]), demo.CONFIG_FLAGS, demo.PRESETS, env=env).engine.endswith(
        "TPLMEngine"
    )
    chosen = parser.parse_args(["--tensor-parallel-size", "2", "--engine", "echo"])
    assert config_from_args(chosen, demo.CONFIG_FLAGS, demo.PRESETS, env={}).engine == "raydp.models.echo:EchoEngine"
    assert config_from_args(parser.parse_args([]), demo.CONFIG_FLAGS, demo.PRESETS, env={}).engine.endswith(
        "TinyLMEngine"
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--graceful-shutdown-s", "-1"), "graceful_shutdown_s=-1"),
        (("--graceful-shutdown-s", "1", "--lb-mode", "hybrid"), "internal only, not hybrid"),
        (
            ("--prefill-dp-size", "1", "--decode-dp-size", "1", "--lb-mode", "external"),
            "--lb-mode=external: P/D pools need API servers that reach both pools",
        ),
        (("--prefill-dp-size", "1"), "prefill_dp_size=1, decode_dp_size=0: a P/D cluster needs"),
    ],
)
def test_a_bad_grace_period_is_refused_before_anything_is_launched(
    flags: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from raydp.cli import main

    assert main(["serve", *flags]) == 2  # before launch: the unit tests forbid ray.init
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "env", "message"),
    [
        (("--api-key", "has space"), {}, "entry 0 (value not shown)"),
        ((), {"RAYDP_API_KEY": ""}, "entry 0 (value not shown)"),  # set but empty: refused, never served open
        (("--protect-metrics",), {}, "protect_metrics=True: needs at least one API key"),
        (("--ssl-certfile", "/nonexistent.pem", "--ssl-keyfile", "/nonexistent.key"), {}, "is no file"),
    ],
)
def test_bad_keys_and_tls_files_are_refused_before_anything_is_launched(
    flags: tuple[str, ...],
    env: dict[str, str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from raydp.cli import main

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "has space" not in err


def test_api_keys_come_from_the_flags_or_else_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from raydp.cli.serve import _server_settings

    parser = subcommands()["serve"]
    monkeypatch.setenv("RAYDP_API_KEY", "sk-env")
    flagged = _server_settings(parser.parse_args(["--api-key", "sk-a", "--api-key", "sk-b", "--protect-metrics"]))
    assert [k.get_secret_value() for k in flagged.api_keys] == ["sk-a", "sk-b"] and flagged.protect_metrics
    from_env = _server_settings(parser.parse_args([]))
    assert [k.get_secret_value() for k in from_env.api_keys] == ["sk-env"]
    monkeypatch.delenv("RAYDP_API_KEY")
    assert _server_settings(parser.parse_args([])).api_keys == ()


def test_serve_flags_reach_the_api_server_settings(tmp_path: Any) -> None:
    from raydp.cli.serve import _server_settings

    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("x")
    key.write_text("x")
    args = subcommands()["serve"].parse_args(
        [
            "--balancer",
            "prefix",
            "--prefix-load-margin",
            "2",
            "--migration-limit",
            "1",
            "--ssl-certfile",
            str(cert),
            "--ssl-keyfile",
            str(key),
            "--no-adapter-affinity",
        ]
    )
    settings = _server_settings(args)
    assert (settings.balancer, settings.prefix_load_margin, settings.migration_limit) == ("prefix", 2, 1)
    assert settings.adapter_affinity is False
    assert (settings.ssl_certfile, settings.ssl_keyfile, settings.scheme) == (str(cert), str(key), "https")
    defaults = _server_settings(subcommands()["serve"].parse_args([]))
    assert (defaults.balancer, defaults.migration_limit, defaults.scheme) == ("least-loaded", 0, "http")
    assert defaults.adapter_affinity is True
