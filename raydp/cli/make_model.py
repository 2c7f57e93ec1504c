"""``raydp make-model``: build the small Llama checkpoint offline, for tests, the demo and benchmarks.

Trains a byte-level BPE tokenizer on an embedded corpus and writes a
Llama-architecture model with seeded random weights (see
:mod:`raydp.models.checkpoint`). Nothing is downloaded. Running it again with
the same parameters finds the checkpoint already built and returns at once.
"""

from __future__ import annotations

import argparse
from typing import Any

from raydp.models.checkpoint import default_model_dir, make_model, parameter_count


def add_parser(sub: Any) -> None:
    """Register the ``make-model`` subcommand on an argparse subparsers object."""
    p = sub.add_parser(
        "make-model",
        help="build a small random-weight Llama checkpoint and tokenizer offline",
        description="Write a Hugging Face checkpoint (LlamaForCausalLM, seeded random float32 weights, "
        "a locally trained byte-level BPE tokenizer with a chat template) that vLLM and transformers "
        "load like any other. The same parameters give byte-identical weights.",
    )
    p.add_argument(
        "dir",
        nargs="?",
        default=None,
        metavar="DIR",
        help="where to write it (default: $RAYDP_MODEL_CACHE, else ~/.cache/raydp/models/tiny-llama)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--hidden-size", type=int, default=128, help="hidden size (default 128)")
    p.add_argument(
        "--heads",
        type=int,
        default=2,
        help="attention heads; hidden-size / heads must be a head size vLLM's CPU backend "
        "supports, such as 64 (default 2)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=1024,
        help="tokenizer vocabulary, at most what the embedded corpus allows (default 1024)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="rebuild even if DIR already holds this checkpoint, replacing whatever is there",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Build (or find) the checkpoint and print where it is; a ConfigError exits 2 via raydp.cli.main."""
    path = make_model(
        args.dir if args.dir is not None else default_model_dir(),
        seed=args.seed,
        layers=args.layers,
        hidden_size=args.hidden_size,
        heads=args.heads,
        vocab_size=args.vocab_size,
        overwrite=args.overwrite,
    )
    print(f"{path}  ({parameter_count(path):,} parameters)")
    return 0
