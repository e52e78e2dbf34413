"""MetricsBoard: a small named Ray actor (no CPU) where each replica leaves its last report, read by
the ingress's /metrics. Named per application, so two kvgen deployments on one cluster keep apart."""

from __future__ import annotations

import time
from typing import Any

import ray

NAMESPACE = "kvgen"


@ray.remote(num_cpus=0)
class MetricsBoard:
    def __init__(self) -> None:
        self.reports: dict[str, dict[str, Any]] = {}

    def report(self, replica: str, summary: dict[str, Any]) -> None:
        self.reports[replica] = summary | {"reported_at": time.time()}

    def read(self) -> dict[str, dict[str, Any]]:
        return self.reports

    def reset(self) -> None:
        self.reports = {}


def board(app_name: str):
    """The application's board, created on first use (detached: it outlives the replicas that write it)."""
    return MetricsBoard.options(name=f"metrics-{app_name}", namespace=NAMESPACE, get_if_exists=True,
                                lifetime="detached").remote()  # fmt: skip
