"""The ingress's /metrics: every replica's last report (replicas/replica_stats.py) as Prometheus
text, per replica and summed. A replica that died keeps its last counts (its requests happened),
shown with kvgen_replica_up 0 once it has not reported for `stale_s`."""

from __future__ import annotations

from typing import Any

_COUNTERS = (
    ("kvgen_replica_requests_total", "requests", "Requests a replica finished, any outcome"),
    ("kvgen_replica_requests_ok_total", "requests_ok", "Requests a replica answered successfully"),
    ("kvgen_replica_prompt_tokens_total", "prompt_tokens", "Prompt tokens of a replica's finished requests"),
    ("kvgen_replica_generation_tokens_total", "generation_tokens", "Tokens a replica generated"),
    ("kvgen_replica_prefix_tokens_queried_total", "prompt_tokens_queried", "Prompt tokens looked up in a replica's prefix cache"),
    ("kvgen_replica_prefix_tokens_reused_total", "prompt_tokens_reused", "Prompt tokens a replica served from its prefix cache"),
)


def hit_rate(reused: float, queried: float) -> float:
    return reused / queried if queried else 0.0


def render(reports: dict[str, dict[str, Any]], now: float, stale_s: float = 10.0) -> str:
    lines: list[str] = []
    replicas = sorted(reports)
    up = {r: now - reports[r].get("reported_at", 0.0) <= stale_s for r in replicas}
    lines += ["# HELP kvgen_replicas_up Replicas that reported within the last few seconds", "# TYPE kvgen_replicas_up gauge",
              f"kvgen_replicas_up {sum(up.values())}"]  # fmt: skip
    lines += ["# HELP kvgen_replica_up Whether a replica reported recently (1) or has gone (0)", "# TYPE kvgen_replica_up gauge"]
    lines += [f'kvgen_replica_up{{replica="{r}"}} {int(up[r])}' for r in replicas]
    for name, key, text in _COUNTERS:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} counter"]
        lines += [f'{name}{{replica="{r}"}} {float(reports[r].get(key, 0.0))}' for r in replicas]
        total = name.replace("kvgen_replica_", "kvgen_cluster_")
        lines += [f"# HELP {total} {text}, summed over replicas", f"# TYPE {total} counter",
                  f"{total} {sum(float(reports[r].get(key, 0.0)) for r in replicas)}"]  # fmt: skip
    lines += ["# HELP kvgen_replica_prefix_hit_rate Share of a replica's prompt tokens served from its prefix cache",
              "# TYPE kvgen_replica_prefix_hit_rate gauge"]  # fmt: skip
    for r in replicas:
        rate = hit_rate(reports[r].get("prompt_tokens_reused", 0), reports[r].get("prompt_tokens_queried", 0))
        lines.append(f'kvgen_replica_prefix_hit_rate{{replica="{r}"}} {rate}')
    reused = sum(reports[r].get("prompt_tokens_reused", 0) for r in replicas)
    queried = sum(reports[r].get("prompt_tokens_queried", 0) for r in replicas)
    lines += ["# HELP kvgen_cluster_prefix_hit_rate Share of all prompt tokens served from a prefix cache",
              "# TYPE kvgen_cluster_prefix_hit_rate gauge", f"kvgen_cluster_prefix_hit_rate {hit_rate(reused, queried)}"]  # fmt: skip
    return "\n".join(lines) + "\n"
