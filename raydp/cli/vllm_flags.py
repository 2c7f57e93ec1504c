"""vLLM's own engine flags on raydp's command line, for ``--engine vllm``.

``raydp serve --engine vllm --model DIR --max-model-len 2048 --enforce-eager``:
the flags raydp does not know are parsed by vLLM's own argument parser
(``EngineArgs.add_cli_args``), so they take exactly the spellings, types and
choices of ``vllm serve``; the ones that differ from vLLM's defaults become
the rank's ``engine_kwargs``. Flags that name raydp's own settings
(``--tensor-parallel-size``, ``--dp-size``) are raydp's and never reach here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from raydp.errors import ConfigError

VLLM_ENGINES: Final = ("raydp.models.vllm:VllmEngine", "raydp.models.vllm:VllmTPEngine")
_PLAIN = (str, int, float, bool, type(None))


def is_vllm(engine: object) -> bool:
    return engine in VLLM_ENGINES


def engine_kwargs(model: str | None, flags: Sequence[str]) -> dict[str, Any]:
    """The engine_kwargs of ``--model`` and the extra ``flags``; ConfigError naming a bad flag."""
    if not model:
        raise ConfigError("--model: required with --engine vllm (a local Hugging Face checkpoint directory)")
    parser = _parser()
    try:
        given = parser.parse_args(["--model", model, *flags])
    except SystemExit:  # argparse printed vLLM's own message (it names the flag)
        raise ConfigError(f"vLLM engine flags {' '.join(flags)!r}: vLLM's parser refused them (see above)") from None
    defaults = vars(parser.parse_args([]))
    chosen = {k: v for k, v in vars(given).items() if defaults.get(k) != v}
    for key, value in chosen.items():
        if not isinstance(value, _PLAIN) and not _plain_list(value):
            raise ConfigError(
                f"--{key.replace('_', '-')}={value!r}: raydp passes only plain values through; "
                "set this one with engine_kwargs in raydp.launch"
            )
    return chosen


def unknown_flags(flags: Sequence[str]) -> None:
    """Extra flags for an engine that takes none: the error argparse would have given."""
    if flags:
        raise ConfigError(f"unrecognized arguments: {' '.join(flags)} (only --engine vllm passes engine flags on)")


def _plain_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, _PLAIN) for v in value)


def _parser() -> Any:
    from raydp.models.vllm_config import set_process_environment

    set_process_environment()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return EngineArgs.add_cli_args(FlexibleArgumentParser(prog="raydp serve --engine vllm"))
