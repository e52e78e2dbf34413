"""What a replicated deployment is made of, checked before Ray starts: the engine every replica
builds (ReplicaSpec) and how many replicas Ray Serve runs and routes to (ReplicaOptions)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kvgen.engine.config import EngineConfig
from kvgen.server.config import ServerConfig

RouterKind = Literal["prefix", "pow2"]
ROUTERS: tuple[str, ...] = ("prefix", "pow2")
PREFIX_ROUTER = "kvgen.replicas.router:PrefixAwareRouter"


@dataclass(frozen=True)
class ReplicaSpec:
    """One replica's engine: the model (LLM.load's arguments) and the engine and server options,
    the same for every replica."""

    model: str
    load_options: dict[str, Any]  # dtype, weights, max_context, cache (a CacheConfig)
    engine: EngineConfig
    server: ServerConfig


@dataclass(frozen=True)
class ReplicaOptions:
    """replicas: how many (the start count when autoscaling). min/max_replicas: autoscale between
    them, aiming at `target_ongoing_requests` per replica. cpus_per_replica: the CPUs Ray reserves
    for each, and its torch threads. router: 'prefix' (kvgen's prefix-aware router) or 'pow2' (Ray's
    default power-of-two choices). imbalance: how many more queued requests the prefix match may
    have than the least loaded replica before the request goes to the least loaded instead."""

    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    cpus_per_replica: float = 1.0
    max_ongoing_requests: int = 64
    router: RouterKind = "prefix"
    imbalance: int = 8
    stats_period_s: float = 1.0
    retries: int = 2  # more replicas tried for a request whose replica died before it answered

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"--replicas must be an integer >= 1, got {self.replicas!r}")
        if self.router not in ROUTERS:
            raise ValueError(f"--router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.cpus_per_replica <= 0:
            raise ValueError(f"--replica-cpus must be positive, got {self.cpus_per_replica!r}")
        for name in ("max_ongoing_requests", "imbalance", "retries"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (0 if name != "max_ongoing_requests" else 1):
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if self.autoscaling:
            low = 1 if self.min_replicas is None else self.min_replicas
            high = max(low, self.replicas) if self.max_replicas is None else self.max_replicas
            if low < 0 or high < max(low, 1) or not low <= self.replicas <= high:
                raise ValueError(f"autoscaling needs 0 <= --min-replicas <= --replicas <= --max-replicas, got "
                                 f"{low} <= {self.replicas} <= {high}")  # fmt: skip
            if self.target_ongoing_requests is not None and self.target_ongoing_requests <= 0:
                raise ValueError(f"--target-ongoing-requests must be positive, got {self.target_ongoing_requests!r}")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None or self.target_ongoing_requests is not None

    def deployment_options(self) -> dict[str, Any]:
        """The engine deployment's options for `serve.deployment` (Ray Serve's own names)."""
        options: dict[str, Any] = {
            "ray_actor_options": {"num_cpus": self.cpus_per_replica},
            "max_ongoing_requests": self.max_ongoing_requests,
            "health_check_period_s": 2.0,
            "health_check_timeout_s": 30.0,
        }
        if self.autoscaling:
            low = 1 if self.min_replicas is None else self.min_replicas
            config: dict[str, Any] = {"min_replicas": low, "initial_replicas": self.replicas,
                                      "max_replicas": max(low, self.replicas) if self.max_replicas is None else self.max_replicas}  # fmt: skip
            if self.target_ongoing_requests is not None:
                config["target_ongoing_requests"] = self.target_ongoing_requests
            options["autoscaling_config"] = config
        else:
            options["num_replicas"] = self.replicas
        return options
