"""vLLM's own flags on raydp's command line, for ``--engine vllm``.

``raydp serve --engine vllm --model DIR --max-model-len 2048 --served-model-name m``:
the flags raydp does not know are parsed by ``vllm serve``'s own argument
parser (``make_arg_parser``: vLLM's front-end and engine arguments), so they
take exactly its spellings, types, choices and meanings. The engine arguments
that differ from vLLM's defaults become the ranks' ``engine_kwargs``; the
API servers, which run vLLM's own front-end, get every flag
(:func:`frontend_flags`). Flags that name raydp's own settings
(``--tensor-parallel-size``, ``--dp-size``, ``--host``, ``--port``,
``--api-key``, ``--ssl-*``) are raydp's and never reach here; the ones for
vLLM's own data parallelism are refused, naming raydp's flag
(:data:`RAYDP_OWNS`). :func:`start_fork_server_early` starts the fork server
vLLM's processes come from before those flags are checked.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from typing import Any, Final

from raydp.errors import ConfigError

VLLM_ENGINES: Final = ("raydp.models.vllm:VllmEngine", "raydp.models.vllm:VllmTPEngine")
_PLAIN = (str, int, float, bool, type(None))
# vllm serve's flags for what raydp does itself: refused, with the flag (or the reason) to use instead.
RAYDP_OWNS: Final = {
    "data_parallel_size": "--dp-size",
    "data_parallel_size_local": "--dp-size-local",
    "data_parallel_backend": "nothing: raydp places the ranks itself (--backend ray or mp)",
    "data_parallel_address": "nothing: raydp places the ranks itself",
    "data_parallel_rpc_port": "nothing: raydp's ranks have their own sockets",
    "data_parallel_start_rank": "nothing: raydp numbers the ranks",
    "data_parallel_rank": "nothing: raydp numbers the ranks",
    "data_parallel_hybrid_lb": "--lb-mode hybrid",
    "data_parallel_external_lb": "--lb-mode external",
    "headless": "nothing: raydp starts every rank from one command (raydp scale adds more)",
    "api_server_count": "--api-servers",
}


def is_vllm(engine: object) -> bool:
    return engine in VLLM_ENGINES


def start_fork_server_early(engine: object, args: argparse.Namespace) -> None:
    """vLLM's processes fork from a server that imports vLLM (:mod:`raydp.fork_server`). Started before the
    command checks vLLM's flags (vLLM's parser, seconds of imports), its import runs beside that one instead
    of after it. Only where the command forks them (the mp backend's ranks, API servers on its machine), and
    only for a model directory that exists, so that a command refused at once starts nothing."""
    forks_here = args.backend == "mp" or args.lb_mode == "internal"
    model = getattr(args, "model", None)
    if is_vllm(engine) and forks_here and model and os.path.isdir(model):
        from raydp.fork_server import start_early
        from raydp.models.vllm.config import FORK_SERVER_PRELOAD

        start_early(FORK_SERVER_PRELOAD)


def engine_kwargs(model: str | None, flags: Sequence[str]) -> dict[str, Any]:
    """The engine_kwargs of ``--model`` and the extra ``flags``; ConfigError naming a bad flag."""
    if not model:
        raise ConfigError("--model: required with --engine vllm (a local Hugging Face checkpoint directory)")
    chosen = _given(model, flags)
    from vllm.engine.arg_utils import EngineArgs

    engine_fields = set(EngineArgs.__dataclass_fields__)
    chosen = {k: v for k, v in chosen.items() if k in engine_fields}
    for key, value in chosen.items():
        raw = _json_flag(flags, key)
        if raw is not None:  # a config object (--kv-transfer-config): the user's own JSON, not every field
            chosen[key] = raw
        elif not isinstance(value, _PLAIN) and not _plain_list(value):
            raise ConfigError(
                f"--{key.replace('_', '-')}={value!r}: raydp passes only plain values through; "
                "set this one with engine_kwargs in raydp.launch"
            )
    return chosen


def _json_flag(flags: Sequence[str], key: str) -> dict[str, Any] | None:
    """The JSON object given to ``--<key>`` (as ``--k JSON`` or ``--k=JSON``), None if it was not one."""
    flag = f"--{key.replace('_', '-')}"
    for i, item in enumerate(flags):
        if item == flag and i + 1 < len(flags):
            text = flags[i + 1]
        elif item.startswith(flag + "="):
            text = item[len(flag) + 1 :]
        else:
            continue
        try:
            value = json.loads(text)
        except ValueError:
            return None
        return value if isinstance(value, dict) else None
    return None


def frontend_flags(model: str, flags: Sequence[str]) -> tuple[str, ...]:
    """The flags an API server running vLLM's front-end parses: ``--model`` then the user's own."""
    _given(model, flags)  # refused here, before anything starts
    return ("--model", model, *flags)


def _given(model: str, flags: Sequence[str]) -> dict[str, Any]:
    """vllm serve's arguments that ``flags`` set to other than the defaults; ConfigError for a refused one."""
    parser = _parser()
    try:
        given = parser.parse_args(["--model", model, *flags])
    except SystemExit:  # argparse printed vLLM's own message (it names the flag)
        raise ConfigError(f"vLLM flags {' '.join(flags)!r}: vLLM's parser refused them (see above)") from None
    defaults = vars(parser.parse_args([]))
    chosen = {k: v for k, v in vars(given).items() if defaults.get(k) != v}
    for key, instead in RAYDP_OWNS.items():
        if key in chosen:
            raise ConfigError(
                f"--{key.replace('_', '-')}={chosen[key]!r}: raydp runs the data parallelism itself; use {instead}"
            )
    return chosen


def unknown_flags(flags: Sequence[str]) -> None:
    """Extra flags for an engine that takes none: the error argparse would have given."""
    if flags:
        raise ConfigError(f"unrecognized arguments: {' '.join(flags)} (only --engine vllm passes engine flags on)")


def _plain_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, _PLAIN) for v in value)


def _parser() -> Any:
    from raydp.models.vllm.config import set_process_environment

    set_process_environment()
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="raydp serve --engine vllm"))
