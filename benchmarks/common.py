"""What every benchmark section shares: sizes, constants, the ratio format, progress logs."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

ECHO_ENGINE = "raydp.models.echo:EchoEngine"
PROMPT = [1, 2, 3]
DP_SIZE = 2
TIMEOUT_S = 60.0
# Busy requests never finish inside a window: they are aborted after it.
BUSY_MAX_TOKENS = 1_000_000


@dataclass(frozen=True)
class Sizes:
    """Every size the run uses; ``--quick`` picks the small set."""

    pipelined: int  # requests in one pipelined window, at least
    pipelined_s: float  # and it lasts at least this long
    window: int  # requests in flight in the pipelined run
    sequential: int  # requests in one sequential slice
    turns: int  # windows and slices per system (the systems measured side by side take turns)
    warmup: int  # untimed sequential requests before each system
    busy_per_rank: int  # pinned long requests per rank in the step-rate runs with a step delay
    busy_per_rank_no_delay: int  # the same at step_delay_s=0 (see FULL)
    step_window_s: float  # one step-rate measurement window
    step_windows: int  # windows per cluster (the median is reported)
    step_warmup_s: float  # busy time before the first window
    step_delays_s: tuple[float, ...]  # EchoEngine step_delay_s values


# At step_delay_s=0, 64 requests per rank make ~5x10^5 outputs/s: the one client
# cannot keep up, its backlog grows by GBs and the aborts wait behind it for
# tens of seconds. A few requests keep both ranks busy with near-empty steps,
# which is also the worst case for lockstep (its fixed costs weigh the most).
FULL = Sizes(
    pipelined=1_000,
    pipelined_s=0.5,
    window=256,
    sequential=250,
    turns=12,
    warmup=50,
    busy_per_rank=64,
    busy_per_rank_no_delay=4,
    step_window_s=1.5,
    step_windows=5,
    step_warmup_s=0.5,
    step_delays_s=(0.002, 0.0),
)
QUICK = Sizes(
    pipelined=300,
    pipelined_s=0.1,
    window=256,
    sequential=20,
    turns=2,
    warmup=10,
    busy_per_rank=64,
    busy_per_rank_no_delay=4,
    step_window_s=0.5,
    step_windows=1,
    step_warmup_s=0.2,
    step_delays_s=(0.002, 0.0),
)


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if a > 0 and b > 0 else "n/a"


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def quiet_serve_logs() -> None:
    """The driver-side router warns on every slow queue-length probe: too chatty on 2 cores."""
    import logging

    logging.getLogger("ray.serve").setLevel(logging.ERROR)
