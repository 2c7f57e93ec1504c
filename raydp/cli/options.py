"""Command-line flags made from :class:`~raydp.config.RaydpConfig`'s fields.

Each flag takes its type, choices and help from the field, and has no
argparse default: a flag the user did not give is absent from the parsed
namespace, so the value comes from ``RAYDP_<FIELD>`` if set, else from the
command's preset, else from the field's own default. Defaults are declared
once, in the config.
"""

from __future__ import annotations

import argparse
import os
import types
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union, get_args, get_origin

from raydp.config import ENV_PREFIX, AutoscalingConfig, RaydpConfig, env_fields
from raydp.errors import ConfigError

# Short names the CLI accepts for ``--engine`` (and RAYDP_ENGINE), besides 'module:Class' paths.
ENGINES = {
    "tiny-lm": "raydp.models.tiny_lm:TinyLMEngine",
    "tp-lm": "raydp.models.tp_lm:TPLMEngine",
    "echo": "raydp.models.echo:EchoEngine",
    "echo-workers": "raydp.models.echo_workers:WorkerEchoEngine",
    "vllm": "raydp.models.vllm:VllmEngine",
}

# Where `raydp demo` and `raydp serve` start: a small DP cluster of the reference LM.
SERVING_PRESETS: dict[str, Any] = {"dp_size": 2, "engine": "tiny-lm"}
# The preset's engine when each rank has several devices: the one that shards over them.
TENSOR_PARALLEL_ENGINE = "tp-lm"
VLLM_TENSOR_PARALLEL_ENGINE = "raydp.models.vllm:VllmTPEngine"  # vLLM's workers in raydp's device workers
SHARDING_FIELDS = ("tensor_parallel_size", "prefill_tensor_parallel_size")

# A flag spelled differently from its field; the field's own flag works too.
ALIASES: dict[str, tuple[str, ...]] = {
    "placement_strategy": ("--strategy",),
    "node_allowlist": ("--allow",),
    "master_node_id": ("--master",),
}


def add_config_flags(parser: argparse.ArgumentParser, fields: Sequence[str], presets: Mapping[str, Any]) -> None:
    """Add one flag per config field in ``fields``; help shows the default in force."""
    group = parser.add_argument_group("cluster config", f"each flag can also be set as {ENV_PREFIX}<FIELD>")
    for name in fields:
        info = RaydpConfig.model_fields[name]
        flags = [f"--{name.replace('_', '-')}", *ALIASES.get(name, ())]
        default = presets.get(name, info.default)
        env = ENV_PREFIX + name.upper()
        shown = f"default {default}; " if default is not None else ""
        help_text = f"{info.description or name.replace('_', ' ')} ({shown}env {env})"
        group.add_argument(*flags, dest=name, default=argparse.SUPPRESS, help=help_text, **_kind(info.annotation))


def _kind(annotation: Any) -> dict[str, Any]:
    """argparse keywords for a field's type: bools toggle, literals choose, tuples repeat."""
    inner = _without_none(annotation)
    if inner is bool:
        return {"action": argparse.BooleanOptionalAction}
    if get_origin(inner) is Literal:
        return {"choices": get_args(inner)}
    if get_origin(inner) is tuple:
        return {"action": "append", "metavar": "VALUE"}
    if inner in (int, float):
        return {"type": inner}
    return {}


def _without_none(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def config_from_args(
    args: argparse.Namespace,
    fields: Sequence[str],
    presets: Mapping[str, Any],
    env: Mapping[str, str] | None = None,
) -> RaydpConfig:
    """Flags over ``RAYDP_*`` over the command's presets over the field defaults."""
    given = {name: getattr(args, name) for name in fields if hasattr(args, name)}
    environ = os.environ if env is None else env
    chosen = {**env_fields(environ), **given}
    pooled = "prefill_dp_size" in chosen or "decode_dp_size" in chosen
    # P/D pools size the cluster themselves: a command's preset dp_size must not contradict them.
    fields_in_force = {**{k: v for k, v in presets.items() if not (pooled and k == "dp_size")}, **chosen}
    # A rank of more than one device (in either P/D pool) needs an engine that drives device workers.
    sharded = any(_more_than_one(fields_in_force.get(f)) for f in SHARDING_FIELDS)
    if "engine" in presets and "engine" not in chosen and sharded:
        fields_in_force["engine"] = TENSOR_PARALLEL_ENGINE
    if isinstance(fields_in_force.get("engine"), str):
        fields_in_force["engine"] = ENGINES.get(fields_in_force["engine"], fields_in_force["engine"])
    if fields_in_force.get("engine") == ENGINES["vllm"] and sharded:
        fields_in_force["engine"] = VLLM_TENSOR_PARALLEL_ENGINE
    return RaydpConfig(**fields_in_force)


def add_model_flag(parser: argparse.ArgumentParser) -> None:
    """``--model`` and the pass-through of vLLM's own flags (``--engine vllm``)."""
    parser.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="with --engine vllm: a local Hugging Face checkpoint directory; vLLM's own engine "
        "flags (--max-model-len, --dtype, --enforce-eager, ...) pass through",
    )
    parser.set_defaults(engine_flags_ok=True)


def pools_note(config: RaydpConfig) -> str:
    """What a command's start line says of the P/D pools ("" without them)."""
    return f" (P/D: {config.prefill_dp_size} prefill + {config.decode_dp_size} decode)" if config.pooled else ""


def with_engine_flags(config: RaydpConfig, args: argparse.Namespace, default_kwargs: Mapping[str, Any]) -> RaydpConfig:
    """``config`` with ``--model`` and vLLM's flags as engine_kwargs (``default_kwargs`` under them)."""
    from raydp.cli import vllm_flags

    flags: list[str] = getattr(args, "engine_flags", [])
    if not vllm_flags.is_vllm(config.engine):
        vllm_flags.unknown_flags(flags)
        if getattr(args, "model", None):
            raise ConfigError(f"--model={args.model!r}: applies to --engine vllm only (engine={config.engine!r})")
        return config
    kwargs = {**default_kwargs, **vllm_flags.engine_kwargs(args.model, flags), **config.engine_kwargs}
    return config.with_changes(engine_kwargs=kwargs)


def _more_than_one(value: Any) -> bool:
    """A bad value is left for the config to reject, with its own message."""
    try:
        return int(value) > 1
    except (TypeError, ValueError):
        return False


def autoscaled(config: RaydpConfig, args: argparse.Namespace) -> RaydpConfig:
    """``--autoscale`` (a P/D cluster: its decode pool) and ``--prefill-autoscale``, each pool started
    within its bounds."""
    if args.prefill_autoscale is not None:
        if not config.pooled:
            raise ConfigError(
                f"--prefill-autoscale={args.prefill_autoscale}: only a P/D cluster has a prefill pool; "
                "give --prefill-dp-size and --decode-dp-size"
            )
        scaling = AutoscalingConfig.parse(args.prefill_autoscale)
        size = min(scaling.max_dp_size, max(scaling.min_dp_size, config.prefill_dp_size))
        config = config.with_changes(
            prefill_autoscaling=scaling, prefill_dp_size=size, dp_size=size + config.decode_dp_size
        )
    if args.autoscale is not None:
        scaling = AutoscalingConfig.parse(args.autoscale)
        if config.pooled:
            size = min(scaling.max_dp_size, max(scaling.min_dp_size, config.decode_dp_size))
            config = config.with_changes(
                autoscaling=scaling, decode_dp_size=size, dp_size=config.prefill_dp_size + size
            )
        else:
            size = min(scaling.max_dp_size, max(scaling.min_dp_size, config.dp_size))
            config = config.with_changes(autoscaling=scaling, dp_size=size)
    return config
