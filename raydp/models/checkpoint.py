"""A small Llama-architecture checkpoint, built offline, for tests, the demo and benchmarks.

``make_model(DIR)`` writes a directory that ``transformers`` and vLLM load like
any Hugging Face checkpoint: ``config.json`` (``LlamaForCausalLM``),
``model.safetensors`` with float32 weights drawn from a seeded generator,
``generation_config.json``, and a byte-level BPE tokenizer (``tokenizer.json``,
``tokenizer_config.json`` with a chat template) trained here on the embedded
corpus below. Nothing is downloaded; the same arguments give byte-identical
files, so tests can compare outputs across runs and machines.

The model is untrained: its output is noise, but deterministic noise with the
shape, tokenizer and chat handling of a real model. Emoji are kept out of the
corpus so that they encode as several byte tokens, which exercises detokenizing
a character split across tokens.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

from raydp.errors import ConfigError

STAMP = "raydp-model.json"
# Bump when the corpus, template or build changes, so that stale caches rebuild.
FORMAT_VERSION = 1
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")
# 256 byte symbols plus the special tokens: a byte-level BPE cannot be smaller.
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)
# vLLM's CPU attention backend (CPU_ATTN) only has kernels for these head sizes
# (CPUAttentionBackend.get_supported_head_sizes); any other fails at engine start.
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# Large enough that greedy decoding wanders instead of repeating one token
# forever, as it does with the usual 0.02 on a model this small.
INITIALIZER_RANGE = 0.2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '</s>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

CORPUS = (
    "The quick brown fox jumps over the lazy dog.",
    "A data-parallel cluster runs one engine core per rank and balances requests between them.",
    "Each request carries a prompt, a few sampling parameters and a maximum number of tokens.",
    "She sold seashells by the seashore, and the shells she sold were surely seashells.",
    "How much wood would a woodchuck chuck if a woodchuck could chuck wood?",
    "It was the best of times, it was the worst of times, it was the age of wisdom.",
    "Call me Ishmael. Some years ago, never mind how long precisely, I went to sea.",
    "The rain in Spain stays mainly in the plain, said the professor to his student.",
    "Please summarize the following paragraph in three short sentences.",
    "Translate this sentence into French: the weather is lovely today.",
    "What is the capital of France? Paris is the capital and largest city of France.",
    "Write a haiku about autumn leaves falling quietly on a mountain path.",
    "The mitochondria is the powerhouse of the cell, or so the textbooks say.",
    "Numbers like 42, 3.14159, 1024 and 65536 appear often in programs.",
    "def add(a, b): return a + b  # a tiny Python function",
    "for (int i = 0; i < n; ++i) { total += values[i]; }",
    '{"name": "raydp", "ranks": 4, "healthy": true, "latency_ms": 12.5}',
    "Once upon a time, in a kingdom far away, there lived a curious young queen.",
    "The committee postponed its decision until the next quarterly meeting.",
    "Heavy snowfall closed the northern highway for most of the weekend.",
    "Scientists observed a distant galaxy whose light left it billions of years ago.",
    "My grandmother bakes bread every Sunday morning before the market opens.",
    "The orchestra tuned their instruments while the audience found their seats.",
    "Thank you for your message; I will reply as soon as I can.",
    "Error: connection refused while contacting the coordinator at port 5555.",
    "Warning: the cache is almost full, consider evicting old entries.",
    "The river flows through the valley, past the old mill and the stone bridge.",
    "Why do cats sleep so much? Nobody knows, but they seem to enjoy it.",
    "Bicycles, trains and buses carry thousands of commuters into the city each day.",
    "A journey of a thousand miles begins with a single step.",
    "The library opens at nine o'clock and closes at half past six.",
    "Quantum computers use qubits, which can hold superpositions of states.",
    "He whispered the password, but the guard only shook his head.",
    "Fresh tomatoes, basil, olive oil and garlic make a simple summer sauce.",
    "Stock markets rose sharply after the central bank held interest rates steady.",
    "The children built a sandcastle with towers, walls and a deep moat.",
    "Remember to water the plants while we are away on holiday.",
    "Lightning flashed across the sky, followed by a long roll of thunder.",
    "Our team shipped the new release on Friday after two weeks of testing.",
    "The museum displays paintings, sculptures, maps and ancient coins.",
    "We met at a café in Paris; how naïve we were, and what a façade it was.",
    "The résumé listed a début novel, a fiancée, and a soirée at the château.",
    "Über den Wolken muss die Freiheit wohl grenzenlos sein, sagt das Lied.",
    "El niño comió una manzana y bebió jugo de piña en la mañana.",
    "São Paulo, Kraków, Zürich, Malmö and Ærøskøbing are all on the map.",
    "东京是日本的首都，北京是中国的首都。",  # noqa: RUF001 (CJK punctuation on purpose)
    "今日はいい天気ですね。散歩に行きましょう。",
    "서울은 한국의 수도입니다.",
    "Zebras, yaks, jackals and oxen quickly vexed the wizard's jumbo sphinx.",
    "Indeed, everything under the sun is in tune, but the sun is eclipsed by the moon.",
    "Keep calm and carry on; tomorrow is another day with new problems to solve.",
    "Good morning! Good afternoon! Good evening! Good night, and sleep well.",
)


def default_model_dir() -> Path:
    """``$RAYDP_MODEL_CACHE`` if set, else ``~/.cache/raydp/models/tiny-llama``."""
    env = os.environ.get("RAYDP_MODEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "raydp" / "models" / "tiny-llama"


def make_model(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    layers: int = 2,
    hidden_size: int = 128,
    heads: int = 2,
    vocab_size: int = 1024,
    max_position_embeddings: int = 4096,
    overwrite: bool = False,
) -> Path:
    """Build the checkpoint at ``path`` (or find it already built) and return the path.

    A directory stamped with the same parameters is returned untouched unless
    ``overwrite``; any other existing, non-empty ``path`` is an error unless
    ``overwrite``. Raises :class:`~raydp.errors.ConfigError` on a bad argument.
    The vocabulary has ``vocab_size`` entries, or fewer when the embedded corpus
    runs out of merges (about 1,450); ``config.json`` has the actual size.
    """
    params = {
        "format": FORMAT_VERSION,
        "seed": seed,
        "layers": layers,
        "hidden_size": hidden_size,
        "heads": heads,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
    }
    _validate(params)
    target = Path(path).expanduser().absolute()
    if not overwrite and _check_existing(target, params):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename, so that no reader, and no crash,
    # ever sees a half-written checkpoint under the target's name.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users
    try:
        _build(staging, params)
        _move_into_place(staging, target, params, overwrite=overwrite)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def make_lora_adapter(model: str | os.PathLike[str], path: str | os.PathLike[str], seed: int, rank: int = 8) -> Path:
    """A LoRA adapter for the checkpoint at ``model``, made with ``peft`` at ``path`` (once) and returned.

    Its weights are random and non-zero (``init_lora_weights=False``, drawn
    from ``seed``) on ``q_proj`` and ``v_proj``, so each adapter changes the
    model's answers in its own way, as a trained one would; serve it with
    ``--enable-lora --max-lora-rank`` of at least ``rank``.
    """
    out = Path(path)
    if (out / "adapter_config.json").exists():
        return out
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(str(model), local_files_only=True)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(str(out))
    return out


def parameter_count(path: str | os.PathLike[str]) -> int:
    """The number of weights in ``path/model.safetensors``, read from its header alone."""
    with open(Path(path) / "model.safetensors", "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(length))
    return sum(math.prod(info["shape"]) for name, info in header.items() if name != "__metadata__")


def _validate(params: dict[str, int]) -> None:
    lower = {
        "seed": 0,
        "layers": 1,
        "hidden_size": 32,
        "heads": 1,
        "vocab_size": MIN_VOCAB,
        "max_position_embeddings": 16,
    }
    for field, low in lower.items():
        value = params[field]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{field}={value!r}: must be an integer")
        if value < low:
            raise ConfigError(f"{field}={value}: must be at least {low}")
    if params["seed"] >= 2**63:
        raise ConfigError(f"seed={params['seed']}: must be below 2**63 (torch.manual_seed's range)")
    hidden, heads = params["hidden_size"], params["heads"]
    if hidden % heads:
        raise ConfigError(f"heads={heads}: hidden_size={hidden} must be a multiple of heads")
    if hidden // heads not in SUPPORTED_HEAD_DIMS:
        raise ConfigError(
            f"heads={heads}: head_dim = hidden_size // heads = {hidden // heads}, but vLLM's CPU attention "
            f"backend supports only head_dim in {SUPPORTED_HEAD_DIMS}"
        )


def _check_existing(target: Path, params: dict[str, int]) -> bool:
    """True when ``target`` already holds this checkpoint; raises when it holds something else."""
    if not target.exists():
        return False
    if target.is_dir() and not any(target.iterdir()):
        return False
    found = _read_stamp(target)
    if found == params:
        return True
    what = f"holds a checkpoint made with {found}" if found else f"exists but has no {STAMP}"
    raise ConfigError(
        f"path={str(target)!r}: {what}, not one made with {params}; "
        "choose another path or pass overwrite=True (--overwrite) to replace it"
    )


def _read_stamp(target: Path) -> dict[str, Any] | None:
    try:
        stamp: dict[str, Any] = json.loads((target / STAMP).read_text())
    except (OSError, ValueError):
        return None
    return stamp


def _move_into_place(staging: Path, target: Path, params: dict[str, int], *, overwrite: bool) -> None:
    if overwrite and target.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
        os.replace(target, trash / "old")
        shutil.rmtree(trash, ignore_errors=True)
    try:
        # rename() replaces a missing or empty directory atomically and refuses a full one.
        os.rename(staging, target)
    except OSError:
        # Another process finished the same build first: keep its copy.
        if _read_stamp(target) != params:
            raise


def _build(out: Path, params: dict[str, int]) -> None:
    from transformers.utils import logging

    tokenizer = _train_tokenizer(params["vocab_size"], params["max_position_embeddings"])
    # The template inside tokenizer_config.json, where every transformers
    # version and vLLM look, rather than only in v5's chat_template.jinja.
    tokenizer.save_pretrained(str(out), save_jinja_files=False)
    model = _random_model(tokenizer, params)
    quiet = not logging.is_progress_bar_enabled()
    logging.disable_progress_bar()  # a bar for writing one small shard is noise in tests and the CLI
    try:
        model.save_pretrained(str(out), safe_serialization=True)
    finally:
        if not quiet:
            logging.enable_progress_bar()
    (out / STAMP).write_text(json.dumps(params, indent=2, sort_keys=True) + "\n")


def _train_tokenizer(vocab_size: int, max_length: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,  # the corpus is tiny: merge even pairs seen once, to reach vocab_size
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte encodes, seen or not
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS, trainer=trainer)
    bos, eos, pad = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=bos,
        eos_token=eos,
        pad_token=pad,
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_length,
    )


def _random_model(tokenizer: Any, params: dict[str, int]) -> Any:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    hidden, heads = params["hidden_size"], params["heads"]
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=params["layers"],
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=hidden // heads,
        max_position_embeddings=params["max_position_embeddings"],
        tie_word_embeddings=False,
        initializer_range=INITIALIZER_RANGE,
        dtype="float32",
        **ids,
    )
    with torch.random.fork_rng(devices=[]):  # seed our weights without resetting the caller's generator
        torch.manual_seed(params["seed"])
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(**ids)
    return model
