"""What one replica reports (no Ray here): its prefix index's block keys for the router, and a
summary of its metrics (requests, tokens, prefix hits) for the ingress's aggregated /metrics."""

from __future__ import annotations

from typing import Any

from kvgen.replicas.prompt_key import index_keys


def engine_stats(engine) -> dict[str, Any]:
    """Read between steps (AsyncLLMEngine.run_locked): block keys and engine counters."""
    prefix = engine.scheduler.prefix
    stats = prefix.stats if prefix is not None else None
    return {
        "keys": index_keys(prefix) if prefix is not None else [],
        "prompt_tokens_queried": stats.tokens_queried if stats else 0,
        "prompt_tokens_reused": stats.tokens_reused if stats else 0,
        "running": len(engine.requests),
    }


def metric_totals(registry) -> dict[str, float]:
    """Totals of the replica's Prometheus counters (server/metrics.py): requests by outcome, tokens."""
    totals = {"requests": 0.0, "requests_ok": 0.0, "prompt_tokens": 0.0, "generation_tokens": 0.0}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == "kvgen_requests_total":
                totals["requests"] += sample.value
                if sample.labels.get("status") == "ok":
                    totals["requests_ok"] += sample.value
            elif sample.name == "kvgen_prompt_tokens_total":
                totals["prompt_tokens"] += sample.value
            elif sample.name == "kvgen_generation_tokens_total":
                totals["generation_tokens"] += sample.value
    return totals
