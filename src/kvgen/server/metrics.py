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
        self.adapter_requests = Counter("kvgen_adapter_requests", "Finished requests by LoRA adapter (\"\": the base model)",
                                        ["adapter"], registry=r)  # fmt: skip
        self.adapter_generation_tokens = Counter("kvgen_adapter_generation_tokens", "Generated tokens by LoRA adapter (\"\": the base model)",
                                                 ["adapter"], registry=r)  # fmt: skip
        for name in ["", *(async_engine.engine.adapters.names() if async_engine.engine.adapters is not None else [])]:
            self.track_adapter(name)
        _adapter_metrics(r, async_engine.engine.adapters)
        read = async_engine.run_locked
        Gauge("kvgen_kv_blocks_in_use", "KV blocks held by requests or the prefix cache", registry=r).set_function(
            lambda: read(lambda e: e.scheduler.num_blocks_in_use()))
        Gauge("kvgen_kv_blocks_total", "KV blocks in the pool", registry=r).set_function(
            lambda: read(lambda e: e.storage.pool.num_blocks))
        storage = async_engine.engine.storage
        Info("kvgen_kv_storage", "How the pool stores K/V: codecs and block size", registry=r).info({"format": storage.format_key})
        Gauge("kvgen_kv_block_bytes", "Bytes of one pool block (K and V of every layer, or of one layer group: docs/engine.md)", registry=r).set(storage.bytes_per_block())
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

        _kv_tier_metrics(r, read)

    def track_adapter(self, name: str) -> None:
        """Show `name`'s per-adapter series at 0 from now (before its first request)."""
        self.adapter_requests.labels(name)
        self.adapter_generation_tokens.labels(name)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _adapter_metrics(registry: CollectorRegistry, adapters) -> None:  # adapters: AdapterRegistry | None
    """The LoRA adapters in RAM: how many serve requests, their bytes, evictions (the registry's own lock)."""
    if adapters is None:
        return
    Gauge("kvgen_lora_adapters_loaded", "LoRA adapters accepting requests", registry=registry).set_function(lambda: len(adapters.names()))
    Gauge("kvgen_lora_adapter_bytes", "Bytes of LoRA adapter weights in RAM", registry=registry).set_function(adapters.resident_bytes)
    Gauge("kvgen_lora_adapter_budget_bytes", "The RAM budget of LoRA adapter weights (0: no limit)", registry=registry).set_function(
        lambda: adapters.budget_bytes or 0)
    Gauge("kvgen_lora_adapter_evictions", "Adapters evicted from RAM by the memory budget since start", registry=registry).set_function(
        lambda: adapters.evictions)


def _kv_tier_metrics(registry: CollectorRegistry, read) -> None:
    """Blocks, bytes and hits per tier (RAM prefix index, disk), disk traffic, restore time and
    skipped files: plain counters the engine keeps, read under the engine lock."""

    def ram(e) -> tuple[int, int]:
        blocks = e.scheduler.prefix.num_held if e.scheduler.prefix else 0
        return blocks, blocks * e.storage.bytes_per_block()

    def ram_hits(e) -> int:
        if e.scheduler.prefix is None:
            return 0
        reused = e.scheduler.prefix.stats.tokens_reused // e.storage.block_size  # both tiers
        return reused - (e.disk.hits.disk_blocks if e.disk is not None else 0)

    def disk(field: str):
        def value(e) -> float:
            tier = e.disk
            if tier is None:
                return 0.0
            store = tier.store
            values = {"blocks": len(store.entries), "bytes": store.bytes_used, "disk_hits": tier.hits.disk_blocks,
                      "restore": tier.hits.restore_seconds,
                      "damaged": store.stats.damaged_files + store.stats.mismatched_files}  # fmt: skip
            return values[field] if field in values else getattr(store.stats, field)
        return lambda: read(value)

    blocks = Gauge("kvgen_kv_tier_blocks", "Prefix-cache blocks held per tier", ["tier"], registry=registry)
    size = Gauge("kvgen_kv_tier_bytes", "Bytes of prefix-cache blocks per tier", ["tier"], registry=registry)
    hits = Gauge("kvgen_kv_tier_hit_blocks", "Blocks served to requests per tier since start", ["tier"], registry=registry)
    blocks.labels(tier="ram").set_function(lambda: read(lambda e: ram(e)[0]))
    size.labels(tier="ram").set_function(lambda: read(lambda e: ram(e)[1]))
    blocks.labels(tier="disk").set_function(disk("blocks"))
    size.labels(tier="disk").set_function(disk("bytes"))
    hits.labels(tier="ram").set_function(lambda: read(ram_hits))
    hits.labels(tier="disk").set_function(disk("disk_hits"))
    for name, field, text in (
        ("kvgen_kv_disk_written_bytes", "bytes_written", "Bytes of KV blocks written to disk since start"),
        ("kvgen_kv_disk_read_bytes", "bytes_read", "Bytes of KV blocks read back from disk since start"),
        ("kvgen_kv_disk_restore_seconds", "restore", "Seconds spent loading KV blocks back from disk"),
        ("kvgen_kv_disk_skipped_files", "damaged", "Damaged, truncated or mismatched block files skipped"),
        ("kvgen_kv_disk_write_errors", "write_errors", "Block writes that failed (disk full): blocks dropped"),
    ):
        Gauge(name, text, registry=registry).set_function(disk(field))
