"""Prometheus metrics of one server (its own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self, async_engine) -> None:  # AsyncLLMEngine
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvgen_requests", "Requests by endpoint and outcome", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("kvgen_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("kvgen_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("kvgen_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("kvgen_inter_token_latency_seconds", "Time between tokens of a request", buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge("kvgen_requests_in_flight", "Requests the server is serving now", registry=r)
        read = async_engine.run_locked
        Gauge("kvgen_kv_blocks_in_use", "KV blocks held by requests or the prefix cache", registry=r).set_function(
            lambda: read(lambda e: e.scheduler.num_blocks_in_use()))
        Gauge("kvgen_kv_blocks_total", "KV blocks in the pool", registry=r).set_function(
            lambda: read(lambda e: e.storage.pool.num_blocks))
        storage = async_engine.engine.storage
        Info("kvgen_kv_storage", "How the pool stores K/V: codecs and block size", registry=r).info({"format": storage.format_key})
        Gauge("kvgen_kv_block_bytes", "Bytes of one pool block (every layer, K and V)", registry=r).set(storage.bytes_per_block())
        Gauge("kvgen_kv_staging_slots_in_use", "fp32 slots holding unfilled blocks (pools of K/V codes)", registry=r).set_function(
            lambda: read(lambda e: e.storage.num_slots - e.storage.num_free_slots if hasattr(e.storage, "num_slots") else 0))
        Gauge("kvgen_prefix_cache_hit_rate", "Share of prompt tokens served from the prefix cache", registry=r).set_function(
            lambda: read(lambda e: e.scheduler.prefix.stats.hit_rate if e.scheduler.prefix else 0.0))
        Gauge("kvgen_preemptions", "Requests preempted since start", registry=r).set_function(
            lambda: read(lambda e: e.scheduler.num_preemptions))
        Gauge("kvgen_spec_draft_tokens", "Speculative draft tokens verified since start", registry=r).set_function(
            lambda: read(lambda e: e.speculative_totals.proposed_tokens))
        Gauge("kvgen_spec_accepted_tokens", "Speculative draft tokens accepted since start", registry=r).set_function(
            lambda: read(lambda e: e.speculative_totals.accepted_tokens))
        Gauge("kvgen_spec_acceptance_rate", "Accepted / verified draft tokens since start", registry=r).set_function(
            lambda: read(lambda e: e.speculative_totals.acceptance_rate))

    def render(self) -> bytes:
        return generate_latest(self.registry)
