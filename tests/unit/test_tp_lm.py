"""The tensor-parallel reference LM, its shards run in threads with a fake all-reduce (tp_harness)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from raydp.engine.executor import WorkerContext
from raydp.errors import ConfigError
from raydp.models.tp_lm import TPLMEngine, TPLMWorker, logical_weights, save_checkpoint
from raydp.wire.protocol import Request
from tests.unit.tp_harness import ThreadExecutor, context

pytestmark = pytest.mark.timeout(60)

SMALL = {"vocab": 64, "dim": 32, "layers": 2, "heads": 4, "max_len": 32}
PROMPTS = {f"p{i}": [(7 * i + 3 * k) % 97 for k in range(i % 6)] for i in range(8)}  # p0 is empty


def _engine(world_size: int = 1, **kwargs: object) -> TPLMEngine:
    return TPLMEngine(context(ThreadExecutor(world_size)), **{**SMALL, **kwargs})


def _run(engine: TPLMEngine, requests: list[Request]) -> dict[str, list[int]]:
    for request in requests:
        engine.add_request(request)
    got: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished():
        for out in engine.step():
            assert not out.finished or out.finish_reason == "length"
            got[out.request_id].extend(out.token_ids)
    return got


def _generate(world_size: int = 1, max_tokens: int = 6, **kwargs: object) -> dict[str, list[int]]:
    return _run(_engine(world_size, **kwargs), [Request(rid, p, max_tokens) for rid, p in PROMPTS.items()])


def _executor(engine: TPLMEngine) -> ThreadExecutor:
    executor = engine.executor
    assert isinstance(executor, ThreadExecutor)
    return executor


def _cached(engine: TPLMEngine) -> list[int]:
    return [s["cached_sequences"] for s in engine.stats()["workers"]]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_tp_sizes_give_the_same_greedy_tokens(dtype: str) -> None:
    tp1 = _generate(1, dtype=dtype)
    assert all(len(tokens) == 6 for tokens in tp1.values())
    assert len({tuple(t) for t in tp1.values()}) > 1, "different prompts give different outputs"
    assert _generate(2, dtype=dtype) == tp1
    assert _generate(4, dtype=dtype) == tp1


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_dtypes_run(dtype: str) -> None:
    assert all(len(tokens) == 6 for tokens in _generate(2, dtype=dtype).values())


def test_a_request_does_not_depend_on_its_batch() -> None:
    solo = {rid: _run(_engine(2), [Request(rid, p, 5)])[rid] for rid, p in PROMPTS.items()}
    # Two slots: later requests are admitted (prefilled) while others decode, beside other lengths.
    batched = _run(_engine(2, max_running=3), [Request(rid, p, 5) for rid, p in PROMPTS.items()])
    assert batched == solo


def test_prompts_are_wrapped_truncated_and_budgeted_like_tiny_lm() -> None:
    engine = _engine(2)
    long_prompt = list(range(100))  # longer than max_len=32: last 31 tokens kept, budget 1
    got = _run(engine, [Request("long", long_prompt, 9), Request("big", [1000, 1001], 50), Request("zero", [5], 0)])
    assert [len(got[r]) for r in ("long", "big", "zero")] == [1, 30, 1]
    assert _run(_engine(2), [Request("wrapped", [1000 % 64, 1001 % 64], 50)])["wrapped"] == got["big"]
    first = _executor(engine).step_inputs[0]["new"]
    assert [len(tokens) for _, tokens in first] == [31, 2, 1]


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_a_checkpoint_gives_the_seeded_models_outputs(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"model{suffix}"
    save_checkpoint(path, logical_weights(seed=1, **SMALL))
    from_checkpoint = _generate(2, seed=0, checkpoint=str(path))  # the checkpoint wins over the seed
    assert from_checkpoint == _generate(1, seed=1)
    assert from_checkpoint != _generate(1, seed=0)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_a_wrong_shape_checkpoint_is_a_config_error_naming_the_tensor(tmp_path: Path, suffix: str) -> None:
    weights = logical_weights(**SMALL, seed=0)
    weights["layers.1.mlp.up.weight"] = torch.zeros(100, 32)
    path = tmp_path / f"bad{suffix}"
    save_checkpoint(path, weights)
    with pytest.raises(ConfigError, match=r"bad.*layers\.1\.mlp\.up\.weight.*\(100, 32\)"):
        _engine(2, checkpoint=str(path))
    # The workers check too: the checkpoint may exist on their node only.
    worker = TPLMWorker(WorkerContext(0, 0, 1, "n"))
    with pytest.raises(ConfigError, match=r"layers\.1\.mlp\.up\.weight"):
        worker.load_model(**SMALL, seed=0, dtype="float32", checkpoint=str(path))
    del weights["layers.1.mlp.up.weight"]
    save_checkpoint(path, weights)
    with pytest.raises(ConfigError, match=r"layers\.1\.mlp\.up\.weight.* missing"):
        _engine(1, checkpoint=str(path))


@pytest.mark.parametrize(
    ("world_size", "kwargs", "message"),
    [
        (2, {"heads": 3, "dim": 30}, "heads=3: must be divisible by tensor_parallel_size=2"),
        (1, {"dim": 30}, "dim=30: must be divisible by heads=4"),
        (1, {"dtype": "int8"}, "dtype='int8': must be one of float32, float64, bfloat16, float16"),
        (1, {"max_running": 0}, "max_running=0: must be an integer >= 1"),
        (1, {"max_len": 1}, "max_len=1: must be an integer >= 2"),
    ],
)
def test_settings_that_cannot_shard_name_the_field(world_size: int, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        _engine(world_size, **kwargs)


def test_the_engine_needs_an_executor() -> None:
    with pytest.raises(ConfigError, match="executor"):
        TPLMEngine(context(None))


def test_abort_and_finish_free_the_kv_cache_on_every_shard() -> None:
    engine = _engine(2)
    engine.add_request(Request("a", [1, 2, 3], 20))
    engine.add_request(Request("b", [4, 5], 20))
    engine.step()
    engine.step()
    assert _cached(engine) == [2, 2]
    engine.abort(["a"])
    engine.step()  # the free rides on the next step input
    assert _cached(engine) == [1, 1]
    steps = [s["steps"] for s in engine.stats()["workers"]]
    engine.abort(["b", "never-seen"])
    assert engine.step() == []  # nothing running: a free-only step, without a forward
    assert _cached(engine) == [0, 0]
    assert [s["steps"] for s in engine.stats()["workers"]] == steps
    engine.add_request(Request("c", [7], 1))
    assert [o.finished for o in engine.step()] == [True]
    assert _cached(engine) == [1, 1] and engine.has_unfinished(), "a pending free keeps the engine stepping"
    engine.execute_dummy_batch()  # a dummy batch flushes it too
    assert _cached(engine) == [0, 0] and not engine.has_unfinished()
    _run(engine, [Request("d", [7], 3)])
    assert _cached(engine) == [0, 0], "an idle engine holds no KV cache"


def test_continuous_batching_admits_waiting_requests_as_slots_free() -> None:
    engine = _engine(2, max_running=2)
    for rid, max_tokens in (("a", 1), ("b", 3), ("c", 2), ("d", 2)):
        engine.add_request(Request(rid, [len(rid), 1], max_tokens))
    finished_per_step, loads, work = [], [], [engine.work()]
    while engine.has_unfinished():
        finished_per_step.append(sorted(o.request_id for o in engine.step() if o.finished))
        loads.append(engine.load())
        work.append(engine.work())
    # Tokens left to generate, waiting requests' included: what clients route by.
    assert work == [8, 6, 4, 2, 1, 0, 0]
    # The last step only frees d's KV cache (no forward, no outputs).
    assert finished_per_step == [["a"], [], ["b", "c"], [], ["d"], []]
    assert loads == [(2, 1), (1, 2), (1, 0), (0, 1), (0, 0), (0, 0)]
    inputs = _executor(engine).step_inputs
    assert [[s for s, _ in i["new"]] for i in inputs] == [[0, 1], [2], [], [3], [], []]
    assert [[s for s, _ in i["decode"]] for i in inputs] == [[], [1], [1, 2], [], [3], []]
    assert [i["free"] for i in inputs] == [[], [0], [], [1, 2], [], [3]]


def _worker() -> TPLMWorker:
    worker = TPLMWorker(WorkerContext(0, 0, 1, "n"))
    worker.load_model(**SMALL, seed=0, dtype="float64")
    return worker


def test_outputs_are_new_sequences_first_then_decodes() -> None:
    worker = _worker()
    (first,) = worker.execute_step({"new": [[0, [1, 2, 3]]]})
    again, second = worker.execute_step({"new": [[1, [1, 2, 3]]], "decode": [[0, first]]})
    assert again == first  # the new sequence's token comes first
    (alone,) = _worker().execute_step({"new": [[5, [1, 2, 3, first]]]})
    assert second == alone  # a prefill of 4 tokens == a prefill of 3, then a decode of 1


def test_a_sequence_past_max_len_is_refused_before_any_compute() -> None:
    worker = _worker()
    with pytest.raises(ValueError, match="exceed max_len=32"):
        worker.execute_step({"new": [[0, [1] * 20], [1, [2] * 33]]})
    assert worker.stats()["cached_sequences"] == 0


def test_each_step_costs_two_all_reduces_per_layer_whatever_the_batch() -> None:
    engine = _engine(2, layers=3)
    group = _executor(engine).group
    engine.add_request(Request("a", [1], 5))
    engine.step()
    assert group.calls == [6, 6]
    for i in range(6):
        engine.add_request(Request(f"x{i}", list(range(i + 1)), 5))
    engine.step()
    assert group.calls == [12, 12]
    engine.execute_dummy_batch()  # a real forward on every shard
    assert group.calls == [18, 18]
    assert engine.stats()["dummy_steps"] == 1


def test_profile_scopes_only_when_raydp_profile_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    def scopes(env: str) -> set[str]:
        monkeypatch.setenv("RAYDP_PROFILE", env)
        engine = _engine(1)
        engine.add_request(Request("a", [1, 2], 2))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            engine.step()
        return {e.name for e in prof.events() if e.name.startswith("raydp.")}

    assert scopes("1") == {"raydp.tp_lm.stage_inputs", "raydp.tp_lm.forward", "raydp.tp_lm.sample"}
    assert scopes("0") == set()


def test_shutdown_survives_gone_workers() -> None:
    engine = _engine(2)
    engine.add_request(Request("a", [1], 4))
    engine.step()
    _executor(engine).close()
    engine.shutdown()
    assert not engine.has_unfinished()
    assert engine.capacity() == 32 * 32
