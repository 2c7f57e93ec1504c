"""How few adapter loads any routing could reach on :mod:`benchmarks.vllm_dp.loras`'s workload.

Run as ``.venv/bin/python -m benchmarks.vllm_dp.lora_bound [--requests N] [--seeds K]``.

The LoRA benchmark's target is loads at most 0.3x least-loaded's. This
computes, for the same adapter popularity (the Zipf-repeated list ``vllm
bench serve`` draws from, 8 adapters) and the same slots (2 ranks of 2),
three numbers on the same request sequences:

* **least-loaded**: each request to a random rank (what load-only routing
  amounts to when the adapter does not count), each rank's slots evicting
  their least recently used adapter, as vLLM's do;
* **adapter-aware**: raydp's rule (a holder; else a free slot; else the rank
  whose least recently used adapter is asked for least), on the same LRU slots;
* **clairvoyant bound**: Belady's optimal eviction over all 4 slots pooled,
  which knows every future request. No routing over 2 ranks of 2 slots can
  load fewer adapters: a split cache only restricts what a pooled one may hold.

Two pooled caches put the adapter-aware rule among online policies (neither
is a bound): **pooled LRU**, one least-recently-used cache of all 4 slots;
and **pooled, popularity known**, the 3 adapters asked for most over the
whole sequence pinned and the fourth slot cycling (it knows the popularity
in advance, which no router does).

It needs no engine: the loads depend only on the order of adapters asked
for, so this is a count, not a timing, and it is exact for each sequence.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

from benchmarks.vllm_dp.loras import ADAPTERS, SLOTS, zipf_picks

RANKS = 2
Route = Callable[[list["Slots"], str, random.Random, dict[str, float]], int]


class Slots:
    """One rank's adapter slots, least recently used first; counts its loads."""

    def __init__(self, size: int) -> None:
        self.held: OrderedDict[str, None] = OrderedDict()
        self.size, self.loads = size, 0

    def use(self, adapter: str) -> None:
        if adapter in self.held:
            self.held.move_to_end(adapter)
            return
        self.loads += 1
        if len(self.held) >= self.size:
            self.held.popitem(last=False)
        self.held[adapter] = None


def least_loaded(ranks: list[Slots], adapter: str, rng: random.Random, asked: dict[str, float]) -> int:
    return rng.randrange(len(ranks))


def adapter_aware(ranks: list[Slots], adapter: str, rng: random.Random, asked: dict[str, float]) -> int:
    holders = [r for r, s in enumerate(ranks) if adapter in s.held]
    if holders:
        return holders[0]
    free = [r for r, s in enumerate(ranks) if len(s.held) < s.size]
    if free:
        return free[0]
    return min(range(len(ranks)), key=lambda r: asked.get(next(iter(ranks[r].held)), 0.0))


def routed_loads(sequence: Sequence[str], route: Route, seed: int) -> int:
    ranks, rng, asked = [Slots(SLOTS) for _ in range(RANKS)], random.Random(seed), dict[str, float]()
    for adapter in sequence:
        ranks[route(ranks, adapter, rng, asked)].use(adapter)
        asked[adapter] = asked.get(adapter, 0.0) + 1.0
    return sum(s.loads for s in ranks)


def clairvoyant_loads(sequence: Sequence[str], slots: int) -> int:
    """Belady's MIN: on a miss with every slot taken, evict the adapter asked for again last (or never)."""
    upcoming: list[int] = [0] * len(sequence)
    seen: dict[str, int] = {}
    for i in range(len(sequence) - 1, -1, -1):
        upcoming[i], seen[sequence[i]] = seen.get(sequence[i], len(sequence)), i
    held: dict[str, int] = {}  # adapter -> when it is asked for next
    loads = 0
    for i, adapter in enumerate(sequence):
        if adapter not in held:
            loads += 1
            if len(held) >= slots:
                del held[max(held, key=held.__getitem__)]
        held[adapter] = upcoming[i]
    return loads


def pooled_lru_loads(sequence: Sequence[str], slots: int) -> int:
    cache = Slots(slots)
    for adapter in sequence:
        cache.use(adapter)
    return cache.loads


def pooled_popular_loads(sequence: Sequence[str], slots: int) -> int:
    """The ``slots - 1`` adapters asked for most stay loaded (each loaded once); the rest share the last slot."""
    pinned = {adapter for adapter, _ in Counter(sequence).most_common(slots - 1)}
    loads, cycling = len(pinned & set(sequence)), ""
    for adapter in sequence:
        if adapter not in pinned and adapter != cycling:
            loads, cycling = loads + 1, adapter
    return loads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=200, help="as the LoRA benchmark's default")
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args(argv)
    picks = zipf_picks([f"ad{i}" for i in range(1, ADAPTERS + 1)])
    print(
        "| seed | least-loaded | adapter-aware | pooled LRU | pooled, popularity known | clairvoyant bound "
        "| aware / least | pooled LRU / least | popularity known / least | bound / least |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for seed in range(args.seeds):
        sequence = random.Random(seed).choices(picks, k=args.requests)
        base = routed_loads(sequence, least_loaded, seed)
        aware = routed_loads(sequence, adapter_aware, seed)
        lru, popular = pooled_lru_loads(sequence, RANKS * SLOTS), pooled_popular_loads(sequence, RANKS * SLOTS)
        bound = clairvoyant_loads(sequence, RANKS * SLOTS)
        counts = (base, aware, lru, popular, bound)
        ratios = " | ".join(f"{n / base:.2f}x" for n in counts[1:])
        print(f"| {seed} | {' | '.join(map(str, counts))} | {ratios} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
