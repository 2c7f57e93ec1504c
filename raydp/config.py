"""Validated configuration for a raydp cluster.

:class:`RaydpConfig` is validated once, at the public boundary. Fields can be
set from ``RAYDP_<FIELD>`` environment variables (pydantic-settings style:
keyword arguments win over the environment, the environment over defaults).
Every validation failure is a :class:`~raydp.errors.ConfigError` whose message
names the field, the value given and what is allowed.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from raydp.errors import ConfigError

PlacementStrategy = Literal["fill", "strict", "span"]
PLACEMENT_STRATEGIES: tuple[PlacementStrategy, ...] = get_args(PlacementStrategy)
TransportKind = Literal["auto", "ipc", "tcp"]
AuthKind = Literal["curve", "none"]
ENV_PREFIX = "RAYDP_"
_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,40}$"
STARTUP_REPORT_GRACE_S = 10.0  # a process start and imports before the rank's own startup deadline begins
# A process that builds no engine (the coordinator, a device probe, rank 0's actor before its engine) starts
# within this even on a loaded 2-core machine, whatever startup_timeout_s the engines are given.
COMPONENT_START_S = 60.0
# A frozen rank's default silence past step_timeout_s: longer than Ray takes to find a cut-off node dead on a
# busy cluster, so a network partition is reported as the node death it is, not as frozen ranks.
SILENCE_MARGIN_S = 60.0


class AutoscalingConfig(BaseModel):
    """When a cluster changes its size by itself, from the coordinator's load (Ray Serve's defaults where they fit).

    ``target_ongoing_requests`` is per rank (waiting + running, averaged over
    ``look_back_s``); a change waits until the wish for it has held for
    ``upscale_delay_s`` or ``downscale_delay_s``; ``interval_s`` is how often
    the load is read and a decision taken.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    min_dp_size: int = Field(1, ge=1, le=4096, description="never fewer ranks")
    max_dp_size: int = Field(ge=1, le=4096, description="never more ranks")
    target_ongoing_requests: float = Field(2.0, gt=0, description="ongoing requests per rank to aim for")
    upscale_delay_s: float = Field(30.0, ge=0, description="how long more ranks must be wanted before adding them")
    downscale_delay_s: float = Field(600.0, ge=0, description="how long fewer must be wanted before removing")
    look_back_s: float = Field(30.0, gt=0, description="the window the load is averaged over")
    interval_s: float = Field(1.0, gt=0, le=600, description="how often the load is read")
    drain_timeout_s: float = Field(30.0, gt=0, description="how long a scale-down lets removed ranks finish")

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, AutoscalingConfig, "autoscaling config")) from None

    @model_validator(mode="after")
    def _check_bounds(self) -> AutoscalingConfig:
        if self.min_dp_size > self.max_dp_size:
            raise ValueError(f"min_dp_size={self.min_dp_size} must be <= max_dp_size={self.max_dp_size}")
        return self

    @classmethod
    def parse(cls, spec: str) -> AutoscalingConfig:
        """``MIN:MAX`` (the CLI's ``--autoscale``), with the other fields at their defaults."""
        low, sep, high = spec.partition(":")
        if not sep or not low.strip().isdigit() or not high.strip().isdigit():
            raise ConfigError(f"autoscale={spec!r}: must be MIN:MAX, two ints >= 1 (e.g. 1:4)")
        return cls(min_dp_size=int(low), max_dp_size=int(high))


class RaydpConfig(BaseModel):
    """Everything that shapes one raydp cluster.

    ``world_size`` (devices per rank) is ``tensor_parallel_size *
    pipeline_parallel_size``. Time values are in seconds.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    name: str = Field("raydp", pattern=_NAME_PATTERN, description="cluster name; prefixes actors and groups")
    dp_size: int = Field(1, ge=1, le=4096, description="number of data-parallel ranks")
    dp_size_local: int | None = Field(None, ge=1, description="ranks on the master node (default: as many as fit)")
    prefill_dp_size: int = Field(
        0, ge=0, le=4096, description="ranks that only prefill, handing each request's KV to a decode rank (0: none)"
    )
    decode_dp_size: int = Field(
        0, ge=0, le=4096, description="ranks that decode what the prefill ranks prefilled (with --prefill-dp-size)"
    )
    tensor_parallel_size: int = Field(1, ge=1, le=1024, description="devices per rank that shard each layer")
    prefill_tensor_parallel_size: int = Field(
        0, ge=0, le=1024, description="P/D: devices per prefill rank, when not tensor_parallel_size (0: the same)"
    )
    pipeline_parallel_size: int = Field(1, ge=1, le=1024, description="pipeline stages per rank")
    accelerator: str = Field(
        "GPU", min_length=1, pattern=r"^[A-Za-z_][A-Za-z0-9_:.-]*$", description="Ray resource of one device bundle"
    )
    placement_strategy: PlacementStrategy = Field(
        "fill",
        description="fill: master first, then nodes as they fit; strict: the same count per node; "
        "span: one rank over several identical nodes",
    )
    node_allowlist: tuple[str, ...] | None = Field(
        None, description="node ids (or unique prefixes) that may host ranks"
    )
    master_node_id: str | None = Field(
        None, description="node id (or unique prefix) of the master; default the driver's"
    )
    engine: str = Field(
        "raydp.models.echo:EchoEngine", pattern=r"^[\w.]+:[\w.]+$", description="engine core class as 'module:Class'"
    )
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    lockstep: bool = Field(False, description="run ranks in request waves (expert-parallel engines)")
    allreduce_interval: int = Field(32, ge=1, le=1_000_000, description="steps between 'unfinished work' all-reduces")
    allreduce_min_interval_s: float = Field(
        0.02,
        ge=0,
        le=10,
        # Each all-reduce costs a rank ~0.05 ms of dispatch into gloo and gloo's threads ~0.15 ms of CPU:
        # with near-empty steps, 200 a second took a quarter of a rank's step rate; 50 a second, a few %.
        description="more steps between them when steps are short: an interval lasts at least this long",
    )
    stats_interval_s: float = Field(0.1, gt=0, le=60)
    heartbeat_interval_s: float = Field(1.0, gt=0, le=600)
    placement_timeout_s: float = Field(60.0, gt=0)
    startup_timeout_s: float = Field(
        120.0,
        gt=0,
        description="a rank not started (its engine built, its handshake done) within this is wedged: it is "
        "ended with its stack, and a restart or raydp serve's start is tried again under the restart budget",
    )
    step_timeout_s: float | None = Field(
        300.0,
        ge=1.0,
        # vLLM's own bound on one execute_model (VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS) is 300 s: a step
        # vLLM would still wait for is never called hung. Chunked prefill keeps real steps far below it.
        description="a rank whose loop turn (one step, or a collective of its gang) lasts longer is hung: "
        "it is ended and restarted (None: never)",
    )
    silence_timeout_s: float | None = Field(
        None,
        ge=3.0,  # an idle rank speaks every second or two
        description="a rank the coordinator hears nothing from for this long is frozen whole (a stopped "
        "process, native code holding the GIL): it is ended as hung and restarted (None: step_timeout_s + 60 s, "
        "past a cut-off node's death as Ray finds it; not watched when step_timeout_s is None too)",
    )
    handshake_timeout_s: float = Field(60.0, gt=0)
    max_restarts: int = Field(
        0, ge=0, description="restarts allowed per rank within restart_window_s (dense mode; 0: fail-stop)"
    )
    restart_window_s: float = Field(
        600.0, gt=0, description="restarts older than this no longer count against max_restarts"
    )
    restart_backoff_s: float = Field(
        2.0, ge=0, description="wait before a rank's second restart in the window; doubles with each after it"
    )
    restart_backoff_max_s: float = Field(60.0, ge=0, description="the longest wait before a restart")
    coordinator_max_restarts: int = Field(
        3, ge=0, description="restarts allowed for the coordinator (Ray backend; it restarts on its node)"
    )
    transport: TransportKind = Field("auto", description="auto: IPC on one node, TCP across nodes")
    auth: AuthKind = Field(
        "curve", description="'curve': TCP peers must hold the cluster's keys; 'none': trust the network"
    )
    max_message_bytes: int = Field(64 << 20, ge=1 << 16, description="largest socket message accepted")
    high_water_mark: int = Field(100_000, ge=1)
    detached: bool = Field(False, description="actors outlive the launching driver (for attach)")
    autoscaling: AutoscalingConfig | None = Field(
        None,
        description="change dp_size (P/D: the decode pool) by itself with the load (None: a fixed size, "
        "changed by scale())",
    )
    prefill_autoscaling: AutoscalingConfig | None = Field(
        None, description="P/D: change the prefill pool's size by itself with its load (None: changed by scale())"
    )

    def __init__(self, **data: Any) -> None:
        # Every way of building a config raises ConfigError, never pydantic's error.
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc)) from None

    @property
    def startup_wait_s(self) -> float:
        """How long a launcher waits for a rank to start: its own deadline and then some, so that a
        wedged rank's report (with its stuck stack) arrives before the launcher gives up on it."""
        return self.startup_timeout_s + STARTUP_REPORT_GRACE_S

    @property
    def component_start_s(self) -> float:
        """How long to wait for a process that builds no engine: never less than a rank's own wait."""
        return max(self.startup_wait_s, COMPONENT_START_S)

    def with_changes(self, **changes: Any) -> RaydpConfig:
        """A validated copy with ``changes`` applied (``model_copy`` would skip validation)."""
        return RaydpConfig(**{**self.model_dump(), **changes})

    @property
    def uses_curve(self) -> bool:
        """IPC-only clusters rely on their 0700 socket directories instead."""
        return self.auth == "curve" and self.transport != "ipc"

    @property
    def world_size(self) -> int:
        """Devices per rank (a P/D cluster's decode ranks; see :meth:`world_size_of`)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def pools_differ(self) -> bool:
        """Whether a P/D cluster's prefill ranks shard over another number of devices than its decode ranks."""
        return self.prefill_tensor_parallel_size not in (0, self.tensor_parallel_size)

    def world_size_of(self, rank: int) -> int:
        """The devices of ``rank``: the prefill ranks' own size where the pools differ."""
        if self.pools_differ and rank < self.prefill_dp_size:
            return self.prefill_tensor_parallel_size * self.pipeline_parallel_size
        return self.world_size

    def devices_before(self, rank: int) -> int:
        """The devices ranks ``0..rank-1`` take together: where ``rank``'s start when ranks take a
        machine's devices in order (the ``mp`` backend)."""
        return sum(self.world_size_of(r) for r in range(rank))

    @model_validator(mode="before")
    @classmethod
    def _size_pools(cls, data: Any) -> Any:
        """P/D pools: ``dp_size`` is the two pools together (ranks ``0..P-1`` prefill, the rest decode)."""
        if not isinstance(data, dict):
            return data
        prefill, decode = data.get("prefill_dp_size") or 0, data.get("decode_dp_size") or 0
        if not prefill and not decode:
            return data
        if not (isinstance(prefill, int | str) and isinstance(decode, int | str)):
            return data  # pydantic names the bad type
        try:
            total = int(prefill) + int(decode)
        except ValueError:
            return data
        given = data.get("dp_size")
        if given is not None and str(given) != str(total):
            raise ValueError(
                f"dp_size={given}: a P/D cluster's size is prefill_dp_size + decode_dp_size = {total}; "
                "leave dp_size out"
            )
        return {**data, "dp_size": total}

    @model_validator(mode="after")
    def _check_pools(self) -> RaydpConfig:
        if not self.prefill_dp_size and not self.decode_dp_size:
            return self
        if not self.prefill_dp_size or not self.decode_dp_size:
            raise ValueError(
                f"prefill_dp_size={self.prefill_dp_size}, decode_dp_size={self.decode_dp_size}: "
                "a P/D cluster needs at least one rank in each pool"
            )
        if self.lockstep:
            raise ValueError("lockstep=True: P/D pools run dense ranks only")
        return self

    @model_validator(mode="after")
    def _check_prefill_tp(self) -> RaydpConfig:
        if not self.prefill_tensor_parallel_size:
            return self
        if not self.pooled:
            raise ValueError(
                f"prefill_tensor_parallel_size={self.prefill_tensor_parallel_size}: only a P/D cluster "
                "(prefill_dp_size >= 1) has a prefill pool"
            )
        if self.pools_differ and self.dp_size_local is not None:
            raise ValueError(
                f"dp_size_local={self.dp_size_local} with prefill_tensor_parallel_size="
                f"{self.prefill_tensor_parallel_size}: pools of different sizes are planned one after the other; "
                "leave dp_size_local out"
            )
        if self.pools_differ and self.prefill_autoscaling is not None:
            raise ValueError(
                f"prefill_autoscaling with prefill_tensor_parallel_size={self.prefill_tensor_parallel_size} "
                f"!= tensor_parallel_size={self.tensor_parallel_size}: the prefill pool grows by taking a decode "
                "rank, which needs both pools to have one size; give them one, or leave the prefill pool fixed"
            )
        return self

    @model_validator(mode="after")
    def _check_silence(self) -> RaydpConfig:
        silence, step = self.silence_timeout_s, self.step_timeout_s
        if silence is not None and step is not None and silence <= step:
            raise ValueError(
                f"silence_timeout_s={silence} must be > step_timeout_s={step}: a rank says nothing while a step runs"
            )
        return self

    @property
    def silence_bound_s(self) -> float | None:
        """How long a rank may be silent before it counts as frozen (None: not watched)."""
        if self.silence_timeout_s is not None or self.step_timeout_s is None:
            return self.silence_timeout_s
        return self.step_timeout_s + SILENCE_MARGIN_S

    @property
    def pooled(self) -> bool:
        """Whether the ranks are split into a prefill and a decode pool."""
        return self.prefill_dp_size > 0

    @model_validator(mode="after")
    def _check_local_size(self) -> RaydpConfig:
        if self.dp_size_local is not None and self.dp_size_local > self.dp_size:
            raise ValueError(f"dp_size_local={self.dp_size_local} must be <= dp_size={self.dp_size}")
        scaling = self.autoscaling
        # A P/D cluster autoscales its decode pool: the bounds are decode ranks.
        field, size = ("decode_dp_size", self.decode_dp_size) if self.pooled else ("dp_size", self.dp_size)
        if scaling is not None and not scaling.min_dp_size <= size <= scaling.max_dp_size:
            raise ValueError(
                f"{field}={size} must be within autoscaling's [{scaling.min_dp_size}, {scaling.max_dp_size}]"
            )
        prefill = self.prefill_autoscaling
        if prefill is not None and not self.pooled:
            raise ValueError("prefill_autoscaling: only a P/D cluster (prefill_dp_size >= 1) has a prefill pool")
        if prefill is not None and not prefill.min_dp_size <= self.prefill_dp_size <= prefill.max_dp_size:
            raise ValueError(
                f"prefill_dp_size={self.prefill_dp_size} must be within prefill_autoscaling's "
                f"[{prefill.min_dp_size}, {prefill.max_dp_size}]"
            )
        return self

    def config_hash(self) -> str:
        """A hash of the fields every rank must agree on (checked in the handshake)."""
        keys = (
            "name",
            "dp_size",
            "prefill_dp_size",
            "tensor_parallel_size",
            "prefill_tensor_parallel_size",
            "pipeline_parallel_size",
            "engine",
            "engine_kwargs",
            "lockstep",
            "allreduce_interval",
        )
        blob = json.dumps({k: getattr(self, k) for k in keys}, sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    @classmethod
    def create(cls, env: Mapping[str, str] | None = None, **fields: Any) -> RaydpConfig:
        """Build a config from keyword fields over ``RAYDP_*`` environment values."""
        return cls(**{**env_fields(os.environ if env is None else env), **fields})


def env_fields(env: Mapping[str, str]) -> dict[str, Any]:
    """Pick ``RAYDP_<FIELD>`` values out of ``env`` (strings; pydantic coerces them)."""
    out: dict[str, Any] = {}
    for name in RaydpConfig.model_fields:
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is None:
            continue
        if name == "node_allowlist":
            # An empty variable means "not set", never "no node may host a rank".
            nodes = tuple(p.strip() for p in raw.split(",") if p.strip())
            out[name] = nodes or None
        elif name in ("engine_kwargs", "autoscaling", "prefill_autoscaling"):
            out[name] = _parse_json(name, raw)
        else:
            out[name] = raw
    return out


def _parse_json(name: str, raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r}: expected a JSON object") from None


def format_validation_error(
    exc: ValidationError, model: type[BaseModel] | None = None, what: str = "raydp config"
) -> str:
    """One line per problem: ``field=value: what is allowed`` (``model``: whose fields an unknown one is checked
    against; RaydpConfig by default)."""
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "config"
        given = err.get("input")
        if err["type"] == "value_error":
            lines.append(f"{field}: {err['msg'].removeprefix('Value error, ')}")
        elif err["type"] == "extra_forbidden":
            allowed = ", ".join((model or RaydpConfig).model_fields)
            lines.append(f"{field}={given!r}: unknown field; allowed fields: {allowed}")
        else:
            lines.append(f"{field}={given!r}: {err['msg']}")
    return f"invalid {what}: " + "; ".join(lines)
