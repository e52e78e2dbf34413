"""EngineConfig: the knobs of the continuous-batching engine, validated when built."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class EngineConfig:
    """max_tokens_per_step: the token budget of one forward (decodes + prefill chunks).
    max_num_seqs: requests running at once. The KV pool is `kv_budget_mb` of blocks of
    `block_size` tokens. prefix_cache: reuse the KV of shared prompt prefixes (kv/prefix.py),
    evicting unused blocks by `eviction` ("lru" or "lfu") when the pool runs short.
    kv_cache_dir: evicted prefix blocks go to files there and come back on a later match, across
    restarts (kv/disk_tier.py), within `kv_disk_budget_mb` of files. layer_groups: for a model
    with sliding-window layers, split the pool into layer groups so that pages no window sees go
    back to the pool (kv/layer_groups.py); off, or with a kv_cache_dir, a block holds every layer.
    speculative_max_batch: speculative requests whose drafts cost work of their own (the EAGLE head,
    a layer-skip draft, a draft model) draft only while at most this many requests decode, and
    decode plainly beside more; prompt lookup's drafts cost nothing and always run. Each such draft
    runs one request at a time before the batched forward, and the verify rows add compute to a
    forward that batching had made cheap per token: EAGLE's head on SmolLM2 chat requests gave
    1.14x alone, 0.78x with two requests decoding and 0.58x with four (benchmarks/engine_speculative.py)."""

    max_tokens_per_step: int = 512
    max_num_seqs: int = 64
    block_size: int = 16
    kv_budget_mb: float = 512.0
    prefix_cache: bool = True
    eviction: Literal["lru", "lfu"] = "lru"
    max_context: int | None = None
    num_blocks: int | None = None  # an exact pool size, instead of kv_budget_mb (tests, benchmarks)
    kv_cache_dir: str | None = None
    kv_disk_budget_mb: float = 1024.0
    layer_groups: bool = True
    speculative_max_batch: int = 1

    def __post_init__(self) -> None:
        for name in ("max_tokens_per_step", "max_num_seqs", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.kv_budget_mb <= 0:
            raise ValueError(f"kv_budget_mb must be positive, got {self.kv_budget_mb!r}")
        if self.eviction not in ("lru", "lfu"):
            raise ValueError(f"eviction must be 'lru' or 'lfu', got {self.eviction!r}")
        if self.num_blocks is not None and (not isinstance(self.num_blocks, int) or self.num_blocks < 1):
            raise ValueError(f"num_blocks must be an integer >= 1, got {self.num_blocks!r}")
        if not isinstance(self.kv_disk_budget_mb, (int, float)) or self.kv_disk_budget_mb <= 0:
            raise ValueError(f"kv_disk_budget_mb must be positive, got {self.kv_disk_budget_mb!r}")
        if self.kv_cache_dir is not None:
            if not isinstance(self.kv_cache_dir, str) or not self.kv_cache_dir:
                raise ValueError(f"kv_cache_dir must be a directory path, got {self.kv_cache_dir!r}")
            if not self.prefix_cache:
                raise ValueError("kv_cache_dir keeps prefix-cache blocks on disk: it needs prefix_cache=True")
        if not isinstance(self.speculative_max_batch, int) or self.speculative_max_batch < 0:
            raise ValueError(f"speculative_max_batch must be an integer >= 0, got {self.speculative_max_batch!r}")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"max_context must be >= 2, got {self.max_context!r}")
