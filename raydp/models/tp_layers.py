"""The sharded model behind :mod:`raydp.models.tp_lm`: its logical weights and its parallel layers.

The logical (unsharded) weights are named and shaped by :func:`weight_shapes`,
drawn by :func:`logical_weights` or read from a checkpoint. Each layer is built
from the FULL logical weight and keeps only this rank's slice, so every
tensor-parallel size computes the same logical function:

* :class:`ColumnParallelLinear` splits the output features; its output stays
  sharded (no communication);
* :class:`RowParallelLinear` splits the input features; the partial products
  are summed with one all-reduce, then the bias is added once;
* :class:`ParallelAttention` pairs them Megatron-style (QKV column-parallel by
  head, output projection row-parallel), with this rank's heads cached in a
  :class:`KVCache`; :class:`ParallelMLP` does the same for up/down;
* embeddings, layer norms and the LM head are replicated.

That gives exactly two all-reduces per transformer layer per step, whatever
the batch. The all-reduce is a plain callable, so tests can run several shards
in threads of one process without ``torch.distributed``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn import functional

from raydp.errors import ConfigError

AllReduce = Callable[[torch.Tensor], None]
"""Sums a tensor in place over the tensor-parallel group."""


def no_all_reduce(tensor: torch.Tensor) -> None:
    """The all-reduce of a group of one: the partial sum is already the sum."""


def dist_all_reduce(tensor: torch.Tensor) -> None:
    """Sum over the default ``torch.distributed`` group (the rank's device workers)."""
    import torch.distributed as dist

    dist.all_reduce(tensor)


def shard_rows(full: torch.Tensor, rank: int, world_size: int, parts: int = 1) -> torch.Tensor:
    """This rank's slice of dim 0 of ``full``, taken from each of ``parts`` equal blocks.

    ``parts=3`` keeps a fused QKV weight head-aligned: rank r gets its heads'
    rows of Q, of K and of V, rather than a contiguous third of the fused matrix.
    """
    blocks = full.chunk(parts, dim=0)
    return torch.cat([block.chunk(world_size, dim=0)[rank] for block in blocks], dim=0).contiguous()


# ---- the logical (unsharded) weights and their checkpoints ----------------------------------


def weight_shapes(vocab: int, dim: int, layers: int, max_len: int) -> dict[str, tuple[int, ...]]:
    """Every logical tensor's name and shape, in the fixed order they are drawn in."""
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (vocab, dim), "pos.weight": (max_len, dim)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes |= {p + "ln1.weight": (dim,), p + "ln1.bias": (dim,)}
        shapes |= {p + "attn.qkv.weight": (3 * dim, dim), p + "attn.qkv.bias": (3 * dim,)}
        shapes |= {p + "attn.out.weight": (dim, dim), p + "attn.out.bias": (dim,)}
        shapes |= {p + "ln2.weight": (dim,), p + "ln2.bias": (dim,)}
        shapes |= {p + "mlp.up.weight": (4 * dim, dim), p + "mlp.up.bias": (4 * dim,)}
        shapes |= {p + "mlp.down.weight": (dim, 4 * dim), p + "mlp.down.bias": (dim,)}
    return shapes | {"norm.weight": (dim,), "norm.bias": (dim,), "head.weight": (vocab, dim), "head.bias": (vocab,)}


def logical_weights(vocab: int, dim: int, layers: int, heads: int, max_len: int, seed: int) -> dict[str, torch.Tensor]:
    """The full model, drawn in float64 on CPU from one seeded generator in a fixed order.

    Every shard of every TP size slices these same tensors, which is what makes
    TP=1, 2 and 4 compute the same function. ``heads`` does not change any
    shape; it is checked so a bad layout fails here rather than at sharding.
    """
    if dim % heads:
        raise ConfigError(f"dim={dim}: must be divisible by heads={heads}")
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(vocab, dim, layers, max_len).items():
        noise = torch.randn(shape, generator=gen, dtype=torch.float64)
        if name.endswith("bias"):
            weights[name] = noise * 0.02
        elif len(shape) == 1:  # a layer norm's gain
            weights[name] = 1.0 + 0.1 * noise
        elif name in ("embed.weight", "pos.weight"):
            weights[name] = noise
        else:  # a linear layer: unit-variance outputs for unit-variance inputs
            weights[name] = noise / shape[1] ** 0.5
    return weights


def save_checkpoint(path: str | os.PathLike[str], weights: dict[str, torch.Tensor]) -> None:
    """Write logical weights: safetensors for a ``.safetensors`` path, else ``torch.save``."""
    tensors = {name: t.detach().contiguous().cpu() for name, t in weights.items()}
    if str(path).endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(tensors, str(path))
    else:
        torch.save(tensors, path)


def load_checkpoint(path: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """Read logical weights and check them against ``shapes`` (ConfigError naming the tensor)."""
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            weights: dict[str, torch.Tensor] = load_file(path)
        else:
            weights = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ConfigError(f"checkpoint={path!r}: cannot read it ({exc})") from None
    check_shapes(path, {name: tuple(t.shape) for name, t in weights.items()}, shapes)
    return weights


def checkpoint_shapes(path: str) -> dict[str, tuple[int, ...]]:
    """The names and shapes in a checkpoint, reading as little of it as the format allows."""
    try:
        if path.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                return {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
        tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return {name: tuple(t.shape) for name, t in tensors.items()}
    except Exception as exc:
        raise ConfigError(f"checkpoint={path!r}: cannot read it ({exc})") from None


def check_shapes(path: str, got: dict[str, tuple[int, ...]], want: dict[str, tuple[int, ...]]) -> None:
    """ConfigError naming the first missing, unexpected or wrongly shaped tensor."""
    for name, shape in want.items():
        if name not in got:
            raise ConfigError(f"checkpoint={path!r}: tensor {name!r} is missing (the model needs {shape})")
        if got[name] != shape:
            raise ConfigError(f"checkpoint={path!r}: tensor {name!r} has shape {got[name]}, the model needs {shape}")
    extra = sorted(set(got) - set(want))
    if extra:
        raise ConfigError(f"checkpoint={path!r}: tensor {extra[0]!r} is not part of the model")


# ---- the parallel layers ---------------------------------------------------------------------------


class ColumnParallelLinear(nn.Module):  # type: ignore[misc]
    """``y_r = x W_r^T + b_r`` for this rank's output features; no communication."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor, rank: int, world_size: int, parts: int = 1) -> None:
        super().__init__()
        self.weight = nn.Parameter(shard_rows(weight, rank, world_size, parts), requires_grad=False)
        self.bias = nn.Parameter(shard_rows(bias, rank, world_size, parts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):  # type: ignore[misc]
    """``y = sum_r x_r W_r^T + b``: this rank's input slice, then one all-reduce.

    The bias is replicated and added after the reduce, so it counts once rather
    than ``world_size`` times.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor, rank: int, world_size: int, all_reduce: AllReduce
    ) -> None:
        super().__init__()
        shard = weight.chunk(world_size, dim=1)[rank].contiguous()
        self.weight = nn.Parameter(shard, requires_grad=False)
        self.bias = nn.Parameter(bias.clone(), requires_grad=False)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = functional.linear(x, self.weight)
        self.all_reduce(partial)
        return partial + self.bias


class KVCache:
    """One layer's keys and values for this rank's heads, per sequence id.

    Each sequence gets buffers of ``max_len`` positions on first use, so a
    decode step writes in place instead of concatenating.
    """

    def __init__(self, heads: int, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device) -> None:
        self.shape = (heads, max_len, head_dim)
        self.dtype, self.device = dtype, device
        self._entries: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}

    def length(self, seq_id: int) -> int:
        entry = self._entries.get(seq_id)
        return entry[2] if entry is not None else 0

    def append(self, seq_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k, v`` (heads, n, head_dim) after the sequence's cached ones; return all of them."""
        entry = self._entries.get(seq_id)
        if entry is None:
            entry = (self._new(), self._new(), 0)
        keys, values, used = entry
        end = used + k.shape[1]
        if end > self.shape[1]:
            raise ValueError(f"sequence {seq_id}: {end} positions exceed max_len={self.shape[1]}")
        keys[:, used:end] = k
        values[:, used:end] = v
        self._entries[seq_id] = (keys, values, end)
        return keys[:, :end], values[:, :end]

    def _new(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def free(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            self._entries.pop(seq_id, None)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def tokens(self) -> int:
        return sum(used for _, _, used in self._entries.values())


Segment = tuple[int, int, int]
"""``(seq_id, start, count)``: a sequence's rows in a step's flattened tokens."""


class ParallelAttention(nn.Module):  # type: ignore[misc]
    """Causal self-attention over this rank's heads, one sequence at a time.

    The projections see the whole step's tokens at once (one matmul each); the
    attention itself runs per sequence against that sequence's cache, so no
    sequence ever attends to another's tokens or padding.
    """

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        heads: int,
        rank: int,
        world_size: int,
        all_reduce: AllReduce,
        cache: KVCache,
    ) -> None:
        super().__init__()
        dim = weights["out.weight"].shape[0]
        self.heads, self.head_dim = heads // world_size, dim // heads
        self.qkv = ColumnParallelLinear(weights["qkv.weight"], weights["qkv.bias"], rank, world_size, parts=3)
        self.out = RowParallelLinear(weights["out.weight"], weights["out.bias"], rank, world_size, all_reduce)
        self.cache = cache

    def forward(self, x: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.heads, self.head_dim).permute(1, 2, 0, 3)
        mixed = torch.empty_like(q)
        for seq_id, start, count in segments:
            rows = slice(start, start + count)
            keys, values = self.cache.append(seq_id, k[:, rows], v[:, rows])
            mixed[:, rows] = self._attend(q[:, rows], keys, values)
        return self.out(mixed.permute(1, 0, 2).reshape(x.shape[0], self.heads * self.head_dim))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Softmax attention of ``q``'s new positions over every cached one up to each."""
        count, total = q.shape[1], keys.shape[1]
        scores = torch.matmul(q, keys.transpose(1, 2)) / math.sqrt(self.head_dim)
        if count > 1:
            query_pos = torch.arange(total - count, total, device=q.device).unsqueeze(1)
            future = torch.arange(total, device=q.device).unsqueeze(0) > query_pos
            scores = scores.masked_fill(future, float("-inf"))
        return torch.matmul(torch.softmax(scores, dim=-1), values)


class ParallelMLP(nn.Module):  # type: ignore[misc]
    """GELU MLP: up-projection column-parallel, down-projection row-parallel."""

    def __init__(self, weights: dict[str, torch.Tensor], rank: int, world_size: int, all_reduce: AllReduce) -> None:
        super().__init__()
        self.up = ColumnParallelLinear(weights["up.weight"], weights["up.bias"], rank, world_size)
        self.down = RowParallelLinear(weights["down.weight"], weights["down.bias"], rank, world_size, all_reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(functional.gelu(self.up(x)))
        return out


def _sub(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {name[len(prefix) :]: t for name, t in weights.items() if name.startswith(prefix)}


class ParallelBlock(nn.Module):  # type: ignore[misc]
    """A pre-norm transformer layer; its two row-parallel linears are its only all-reduces."""

    def __init__(
        self, w: dict[str, torch.Tensor], heads: int, rank: int, world_size: int, reduce: AllReduce, cache: KVCache
    ) -> None:
        super().__init__()
        self.ln1 = nn.ParameterList([w["ln1.weight"], w["ln1.bias"]]).requires_grad_(False)
        self.ln2 = nn.ParameterList([w["ln2.weight"], w["ln2.bias"]]).requires_grad_(False)
        self.attn = ParallelAttention(_sub(w, "attn."), heads, rank, world_size, reduce, cache)
        self.mlp = ParallelMLP(_sub(w, "mlp."), rank, world_size, reduce)

    def forward(self, x: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        dim = (x.shape[-1],)
        x = x + self.attn(functional.layer_norm(x, dim, self.ln1[0], self.ln1[1]), segments)
        out: torch.Tensor = x + self.mlp(functional.layer_norm(x, dim, self.ln2[0], self.ln2[1]))
        return out


class ShardedTransformer(nn.Module):  # type: ignore[misc]
    """This rank's shard: embeddings, final norm and LM head replicated, layers split by head."""

    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        heads: int,
        rank: int,
        world_size: int,
        reduce: AllReduce,
        caches: Sequence[KVCache],
    ) -> None:
        super().__init__()
        keep = ("embed.weight", "pos.weight", "norm.weight", "norm.bias", "head.weight", "head.bias")
        self.shared = nn.ParameterDict({k.replace(".", "_"): weights[k] for k in keep}).requires_grad_(False)
        self.blocks = nn.ModuleList(
            ParallelBlock(_sub(weights, f"layers.{i}."), heads, rank, world_size, reduce, cache)
            for i, cache in enumerate(caches)
        )

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, segments: Sequence[Segment], last: torch.Tensor
    ) -> torch.Tensor:
        """Next-token logits at rows ``last`` (each segment's last token); all segments in one flat batch."""
        w = self.shared
        x = functional.embedding(tokens, w["embed_weight"]) + functional.embedding(positions, w["pos_weight"])
        for block in self.blocks:
            x = block(x, segments)
        hidden = functional.layer_norm(x[last], (x.shape[-1],), w["norm_weight"], w["norm_bias"])
        return functional.linear(hidden, w["head_weight"], w["head_bias"])


class InputStaging:
    """Host-to-device transfer of a step's integer inputs (token ids, positions, rows to sample).

    On CUDA they go, end to end, through one reused pinned buffer and ONE
    ``non_blocking`` copy of a contiguous slice of it (a strided slice would
    fall back to a pageable temporary). Reusing the buffer is safe: each step
    ends with ``.tolist()`` on the device output, which waits for the stream,
    so the previous copy out of it has finished.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned: torch.Tensor | None = None

    def stage(self, *columns: list[int]) -> list[torch.Tensor]:
        flat = [value for column in columns for value in column]
        host = torch.tensor(flat, dtype=torch.long)
        if self.device.type == "cuda":
            if self._pinned is None or self._pinned.numel() < len(flat):
                self._pinned = torch.empty(max(len(flat), 1024), dtype=torch.long, pin_memory=True)
            self._pinned[: len(flat)].copy_(host)
            host = self._pinned[: len(flat)].to(self.device, non_blocking=True)
        return list(host.split([len(column) for column in columns]))
