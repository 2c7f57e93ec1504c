"""The offline tiny-Llama checkpoint: files, tokenizer, chat template, determinism, validation, CLI, vLLM."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from raydp.cli import main
from raydp.errors import ConfigError
from raydp.models import checkpoint
from raydp.models.checkpoint import STAMP, default_model_dir, make_model, parameter_count
from tests.integration.vllm_helpers import tiny_model, vllm_reference, want_reference

pytestmark = pytest.mark.timeout(300)

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", STAMP)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def test_the_files_are_written(model_dir: Path) -> None:
    for name in FILES:
        assert (model_dir / name).is_file(), name
    assert not [p.name for p in model_dir.parent.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_the_config_is_a_small_llama(model_dir: Path, tokenizer: Any) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["head_dim"] == 64  # vLLM's CPU attention has no kernel for e.g. 16
    assert config["vocab_size"] == len(tokenizer) == 1024
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
    )
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.eos_token_id
    assert parameter_count(model_dir) > 0


@pytest.mark.parametrize("text", ["The quick brown fox jumps over the lazy dog.", "un café naïve, 東京", "x = 42\n"])
def test_the_tokenizer_round_trips(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert all(isinstance(i, int) for i in ids)
    assert tokenizer.decode(ids) == text


def test_an_emoji_is_split_across_byte_tokens(tokenizer: Any) -> None:
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) >= 2
    assert tokenizer.decode(ids) == "🙂"
    assert "🙂" not in tokenizer.decode(ids[:1])  # a prefix alone is not the character


def test_the_chat_template_renders(tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids and all(isinstance(i, int) for i in ids)
    assert tokenizer.decode(ids) == text
    assert "chat_template" in json.loads((Path(tokenizer.name_or_path) / "tokenizer_config.json").read_text())


def test_greedy_output_is_not_one_token_repeated(model_dir: Path, tokenizer: Any) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    for prompt in ("The quick brown fox", "Hello", "def add(a, b):"):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :].tolist()
        assert len(set(out)) >= 4, (prompt, out)


def test_a_second_call_is_a_no_op(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = {name: (model_dir / name).stat().st_mtime_ns for name in FILES}

    def no_build(*args: object) -> None:
        raise AssertionError("rebuilt a checkpoint that was already there")

    monkeypatch.setattr(checkpoint, "_build", no_build)
    assert make_model(model_dir) == model_dir
    assert {name: (model_dir / name).stat().st_mtime_ns for name in FILES} == before


def test_the_same_seed_gives_identical_weights(model_dir: Path, tmp_path: Path) -> None:
    again = make_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name
    other = make_model(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (model_dir / "model.safetensors").read_bytes()


def test_the_callers_random_state_is_left_alone(tmp_path: Path) -> None:
    import torch

    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    make_model(tmp_path / "m", seed=7)
    assert torch.equal(torch.rand(4), expected)


def test_a_different_checkpoint_in_the_way_is_an_error_unless_overwrite(model_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "m"
    make_model(target, seed=1)
    with pytest.raises(ConfigError, match="overwrite"):
        make_model(target, seed=2)
    make_model(target, seed=2, overwrite=True)
    assert json.loads((target / STAMP).read_text())["seed"] == 2
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=STAMP):
        make_model(stranger)
    assert (stranger / "notes.txt").read_text() == "mine"


def test_an_empty_directory_is_filled(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert (make_model(tmp_path / "empty") / "model.safetensors").is_file()


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"heads": 3}, "heads=3: hidden_size=128 must be a multiple of heads"),
        ({"heads": 8}, "heads=8: head_dim"),  # head_dim 16: no vLLM CPU kernel
        ({"hidden_size": 96, "heads": 2}, "head_dim"),  # 48
        ({"layers": 0}, "layers=0"),
        ({"seed": -1}, "seed=-1"),
        ({"vocab_size": 100}, "vocab_size=100"),
        ({"hidden_size": 16, "heads": 1}, "hidden_size=16"),
        ({"max_position_embeddings": 0}, "max_position_embeddings=0"),
        ({"layers": 2.0}, "layers=2.0"),
        ({"layers": True}, "layers=True"),
    ],
)
def test_bad_arguments_name_the_field(tmp_path: Path, kwargs: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(expected)):
        make_model(tmp_path / "bad", **kwargs)
    assert not (tmp_path / "bad").exists()


def test_default_model_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RAYDP_MODEL_CACHE", str(tmp_path / "cache"))
    assert default_model_dir() == tmp_path / "cache"
    monkeypatch.delenv("RAYDP_MODEL_CACHE")
    assert default_model_dir() == Path.home() / ".cache" / "raydp" / "models" / "tiny-llama"


def test_the_cli_makes_a_model(model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "cli"
    assert main(["make-model", str(target), "--seed", "0"]) == 0
    out = capsys.readouterr().out
    assert str(target) in out and f"{parameter_count(target):,} parameters" in out
    assert (target / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()
    assert main(["make-model", str(target), "--heads", "3"]) == 2
    assert "heads=3" in capsys.readouterr().err


def test_the_cli_defaults_to_the_model_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RAYDP_MODEL_CACHE", str(tmp_path / "cache"))
    assert main(["make-model"]) == 0
    assert (tmp_path / "cache" / STAMP).is_file()


# vLLM's offline LLM on the built checkpoint: asked with the integration suite's references, so one vLLM
# start answers this and every vLLM module's expectations (a start costs ~20 s on 2 cores).
GENERATED = want_reference([([5, 6, 7, 8], {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True})])


@pytest.mark.slow
def test_vllm_loads_and_generates(tokenizer: Any) -> None:
    (tokens,) = vllm_reference(tiny_model(), GENERATED)
    assert len(tokens) == 8 and all(0 <= t < len(tokenizer) for t in tokens), tokens
