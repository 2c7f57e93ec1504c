"""A tensor-parallel transformer LM: raydp's reference engine core with device workers.

:class:`TPLMEngine` schedules exactly as :class:`~raydp.models.tiny_lm.TinyLMEngine`
does (greedy decoding, continuous batching, both on :mod:`raydp.models.reference`);
the model lives in ``world_size`` :class:`TPLMWorker` processes, each holding one tensor-parallel shard (see
:mod:`raydp.models.tp_layers`), driven through ``context.executor``.

Each step sends ONE msgpack-able step input to every worker::

    {"new": [[seq_id, [token, ...]], ...],   # prefill of newly admitted sequences
     "decode": [[seq_id, token], ...],       # one token for each running sequence
     "free": [seq_id, ...],                  # KV caches to drop first (finished/aborted)
     "dummy": True}                          # optional: a throwaway 1-token forward

and gets back the greedy next token of each sequence, ``"new"`` ones first and
then ``"decode"`` ones, each in input order. Frees ride on the next step input
(or dummy batch); one with no sequences only frees, without a forward. Weights are seeded (or loaded from
a checkpoint of the logical, unsharded tensors), so every TP size computes the
same greedy tokens.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch

from raydp.engine.core import EngineContext
from raydp.engine.executor import Executor, WorkerContext
from raydp.errors import ConfigError
from raydp.models.reference import ReferenceEngine, Running, fit_prompt
from raydp.models.tp_layers import (
    AllReduce,
    InputStaging,
    KVCache,
    Segment,
    ShardedTransformer,
    check_shapes,
    checkpoint_shapes,
    dist_all_reduce,
    load_checkpoint,
    logical_weights,
    no_all_reduce,
    save_checkpoint,
    weight_shapes,
)
from raydp.wire.protocol import Output, Request

logger = logging.getLogger("raydp.models.tp_lm")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_DUMMY_SEQ = -1  # the throwaway sequence of a dummy forward; freed right after it


@dataclass(frozen=True)
class ModelSettings:
    """What every worker needs to build the same logical model; crosses to them as ``load_model`` kwargs."""

    vocab: int = 256
    dim: int = 64
    layers: int = 2
    heads: int = 4
    max_len: int = 128
    seed: int = 0
    dtype: str = "float32"
    checkpoint: str | None = None

    def check(self, world_size: int) -> None:
        """ConfigError naming the field, the value and what is allowed, for a layout TP cannot shard.

        A checkpoint that exists here is checked too (names and shapes, reading
        only its header where the format allows), so a bad one fails in the
        engine rather than as a worker traceback; one that does not may exist
        on the workers' node only, and they check it when they load it.
        """
        for field, least in (("vocab", 1), ("dim", 1), ("layers", 1), ("heads", 1), ("max_len", 2)):
            _check_int(field, getattr(self, field), least)
        if self.dim % self.heads:
            raise ConfigError(f"dim={self.dim}: must be divisible by heads={self.heads}")
        if self.heads % world_size:
            raise ConfigError(f"heads={self.heads}: must be divisible by tensor_parallel_size={world_size}")
        if (4 * self.dim) % world_size:
            raise ConfigError(f"dim={self.dim}: 4*dim must be divisible by tensor_parallel_size={world_size}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}: must be one of {', '.join(DTYPES)}")
        if self.checkpoint and os.path.exists(self.checkpoint):
            check_shapes(self.checkpoint, checkpoint_shapes(self.checkpoint), self.shapes())

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return weight_shapes(self.vocab, self.dim, self.layers, self.max_len)

    def logical_weights(self) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors if there is one, else the seeded ones."""
        if self.checkpoint:
            return load_checkpoint(self.checkpoint, self.shapes())
        return logical_weights(self.vocab, self.dim, self.layers, self.heads, self.max_len, self.seed)


def _check_int(field: str, value: Any, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ConfigError(f"{field}={value!r}: must be an integer >= {least}")


# ---- one worker's shard ------------------------------------------------------------------------


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


class TPLMWorker:
    """One tensor-parallel shard of the model, with its heads' KV caches.

    ``all_reduce`` defaults to ``torch.distributed.all_reduce`` on the default
    group (a no-op for ``world_size == 1``); tests pass their own to run every
    shard in threads of one process.
    """

    def __init__(self, context: WorkerContext, all_reduce: AllReduce | None = None) -> None:
        self.context = context
        self.device = torch.device(context.device)
        self.all_reduce = all_reduce or (dist_all_reduce if context.world_size > 1 else no_all_reduce)
        self.profile = _env_true("RAYDP_PROFILE")  # read once: no per-step cost when off
        self.model: ShardedTransformer | None = None
        self.caches: list[KVCache] = []
        self.steps = 0
        self._staging = InputStaging(self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(int(os.environ.get("RAYDP_TORCH_THREADS", "1")))

    def load_model(self, **settings: Any) -> dict[str, Any]:
        """Build this rank's shard from the seeded or checkpointed logical weights (``ModelSettings`` fields)."""
        cfg = ModelSettings(**settings)
        dtype = DTYPES[cfg.dtype]
        weights = {name: t.to(dtype) for name, t in cfg.logical_weights().items()}
        rank, size = self.context.tp_rank, self.context.world_size
        shape = (cfg.heads // size, cfg.dim // cfg.heads, cfg.max_len)
        self.caches = [KVCache(*shape, dtype, self.device) for _ in range(cfg.layers)]
        model = ShardedTransformer(weights, cfg.heads, rank, size, self.all_reduce, self.caches)
        self.model = model.to(self.device).eval()
        return {"tp_rank": rank, "params": sum(p.numel() for p in model.parameters()), "device": str(self.device)}

    def execute_step(self, step_input: dict[str, Any]) -> list[int]:
        """Free, then run ``"new"`` and ``"decode"`` sequences; their next tokens in that order."""
        self.free(step_input.get("free", ()))
        seqs = [(int(s), [int(t) for t in toks]) for s, toks in step_input.get("new", ())]
        seqs += [(int(s), [int(t)]) for s, t in step_input.get("decode", ())]
        if step_input.get("dummy"):
            seqs.append((_DUMMY_SEQ, [0]))
        if not seqs:
            return []
        try:
            tokens = self._forward(seqs)
        finally:
            self.free([_DUMMY_SEQ])  # a no-op unless this was a dummy step
        self.steps += 1
        return tokens[:-1] if step_input.get("dummy") else tokens

    def _forward(self, seqs: list[tuple[int, list[int]]]) -> list[int]:
        if self.model is None:
            raise RuntimeError("execute_step before load_model")
        with self._scope("raydp.tp_lm.stage_inputs"):
            tokens, positions, segments = self._flatten(seqs)
            last = [start + count - 1 for _, start, count in segments]
            token_ids, position_ids, last_rows = self._staging.stage(tokens, positions, last)
        with self._scope("raydp.tp_lm.forward"), torch.inference_mode():
            logits = self.model(token_ids, position_ids, segments, last_rows)
        with self._scope("raydp.tp_lm.sample"):
            next_tokens: list[int] = logits.argmax(dim=-1).tolist()
        return next_tokens

    def _flatten(self, seqs: list[tuple[int, list[int]]]) -> tuple[list[int], list[int], list[Segment]]:
        """One flat token list, each token's position (after its cached ones) and each sequence's rows."""
        tokens: list[int] = []
        positions: list[int] = []
        segments: list[Segment] = []
        room = self.caches[0].shape[1]
        for seq_id, toks in seqs:
            cached = self.caches[0].length(seq_id)
            if cached + len(toks) > room:  # checked before any compute, so no cache is half-written
                raise ValueError(f"sequence {seq_id}: {cached} cached + {len(toks)} new tokens exceed max_len={room}")
            segments.append((seq_id, len(tokens), len(toks)))
            tokens += toks
            positions += range(cached, cached + len(toks))
        return tokens, positions, segments

    def _scope(self, name: str) -> contextlib.AbstractContextManager[Any]:
        return torch.profiler.record_function(name) if self.profile else contextlib.nullcontext()

    def free(self, seq_ids: Sequence[int]) -> None:
        """Drop these sequences' KV caches (unknown ids are ignored)."""
        for cache in self.caches:
            cache.free(seq_ids)

    def reset(self) -> None:
        """Drop every KV cache."""
        for cache in self.caches:
            cache.clear()

    shutdown = reset

    def stats(self) -> dict[str, Any]:
        """Forward steps run and KV cache occupancy (every layer holds the same sequences)."""
        return {
            "tp_rank": self.context.tp_rank,
            "steps": self.steps,
            "cached_sequences": len(self.caches[0]) if self.caches else 0,
            "cached_tokens": self.caches[0].tokens() if self.caches else 0,
        }


# ---- the engine core (scheduler) -----------------------------------------------------------------


@dataclass(kw_only=True)
class _Sequence(Running):
    seq_id: int  # the workers' name for its KV caches
    feed: list[int]  # the tokens the next step sends: the prompt, then the last sampled token
    new: bool = True


class TPLMEngine(ReferenceEngine[_Sequence]):
    """Greedy decoding over at most ``max_running`` sequences, on tensor-parallel workers."""

    engine_name: ClassVar[str] = "TPLMEngine"
    worker_class: ClassVar[str] = "raydp.models.tp_lm:TPLMWorker"

    def __init__(
        self,
        context: EngineContext,
        vocab: int = 256,
        dim: int = 64,
        layers: int = 2,
        heads: int = 4,
        max_len: int = 128,
        max_running: int = 32,
        seed: int = 0,
        dtype: str = "float32",
        checkpoint: str | None = None,
    ) -> None:
        if context.executor is None:
            raise ConfigError(
                "TPLMEngine: context.executor is None; it runs its model on device workers, so it must be "
                "started by raydp, which builds the workers named by TPLMEngine.worker_class"
            )
        self.context = context
        self.executor: Executor = context.executor
        self.settings = ModelSettings(vocab, dim, layers, heads, max_len, seed, dtype, checkpoint)
        self.settings.check(self.executor.world_size)
        _check_int("max_running", max_running, 1)
        self.workers = self.executor.collective_rpc("load_model", kwargs=asdict(self.settings))
        super().__init__(max_running)
        self.vocab, self.max_len = vocab, max_len
        self._to_free: list[int] = []  # sent with the next step input
        self._next_seq = 0
        self.steps = self.dummy_steps = 0

    def capacity(self) -> int:
        return self.max_running * self.max_len

    def _start(self, request: Request) -> _Sequence:
        prompt, budget = fit_prompt(request, self.vocab, self.max_len)
        seq_id, self._next_seq = self._next_seq, self._next_seq + 1
        return _Sequence(budget=budget, seq_id=seq_id, feed=prompt)

    def _on_token(self, state: _Sequence, token: int) -> None:
        state.feed, state.new = [token], False  # cached now: the next step sends only this token

    def _release(self, state: _Sequence) -> None:
        self._to_free.append(state.seq_id)  # the workers drop its KV caches at the next step input

    def step(self) -> list[Output]:
        """Admit, then one forward on the workers: prefill for new sequences, a token for the rest."""
        self._admit()
        if not self._running and not self._to_free:
            return []
        new = [rid for rid, s in self._running.items() if s.new]
        decode = [rid for rid, s in self._running.items() if not s.new]
        step_input = {
            "new": [[self._running[rid].seq_id, self._running[rid].feed] for rid in new],
            "decode": [[self._running[rid].seq_id, self._running[rid].feed[-1]] for rid in decode],
            "free": self._take_frees(),
        }
        tokens = self.executor.execute_step(step_input)
        self.steps += 1
        return [self._advance(rid, tok) for rid, tok in zip(new + decode, tokens, strict=True)]

    def _take_frees(self) -> list[int]:
        frees, self._to_free = self._to_free, []
        return frees

    def has_unfinished(self) -> bool:
        # Pending frees count: one more (forward-free) step releases their KV caches,
        # rather than holding them until the next request arrives.
        return super().has_unfinished() or bool(self._to_free)

    def execute_dummy_batch(self) -> None:
        """A throwaway 1-token forward on every worker (lockstep DP needs each rank to run one)."""
        self.executor.execute_step({"new": [], "decode": [], "free": self._take_frees(), "dummy": True})
        self.dummy_steps += 1

    def shutdown(self) -> None:
        """Forget every request and ask the workers to drop their caches, if they are still there."""
        super().shutdown()
        self._to_free.clear()
        try:
            self.executor.collective_rpc("reset", timeout_s=5.0)
        except Exception as exc:  # workers already gone: nothing left to free
            logger.debug("TPLMEngine.shutdown: workers did not reset (%s)", exc)

    def stats(self) -> dict[str, Any]:
        """Scheduler counters and each worker's (called as a utility)."""
        return {
            "steps": self.steps,
            "dummy_steps": self.dummy_steps,
            "waiting": len(self._waiting),
            "running": len(self._running),
            "world_size": self.executor.world_size,
            "workers": self.executor.collective_rpc("stats"),
        }


__all__ = [
    "ModelSettings",
    "TPLMEngine",
    "TPLMWorker",
    "load_checkpoint",
    "logical_weights",
    "save_checkpoint",
    "weight_shapes",
]
