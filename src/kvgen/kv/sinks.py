"""SinkCache: attention sinks (StreamingLLM, Xiao et al. 2023) for generation past any window.

The cache keeps the first `sinks` positions (the "attention sinks" every later query leans on) and
the most recent `window - 1`, so each new query sees the sinks plus a window of `window` positions
(itself included). Positions are those *inside the cache*, as the paper prescribes: when the
oldest window position is evicted, the later keys move back one slot and are re-rotated by the
model's `rerotate` (RoPE angles add, so this is exact), and the next token is embedded at position
`seq_len`. Rotary positions therefore never exceed sinks + window, whatever the length of the text.

`seq_len` counts cache positions, not tokens seen; `tokens_seen` counts those. After the first
eviction the cache is no prefix of the text: rewinding is refused (`can_resume` is False) and
`positions_removed` is non-zero. Within one multi-token forward pass the mask gives each query the
sinks and its last `window` positions, with text-order positions; the eviction at `commit` then
brings the cache back to sinks + window - 1.

Eviction happens at every commit past the limit: one move of window keys per layer and token, the
price of the exact cache positions (a lazier eviction would let the sinks drift further away).
"""

from __future__ import annotations

import torch

from kvgen.config import ModelConfig
from kvgen.kv.contiguous import ContiguousCache
from kvgen.kv.interface import AttentionSpan, CacheSpec, KVCache, Rerotate


class SinkCache(KVCache):
    def __init__(self, spec: CacheSpec, sinks: int, window: int, rerotate: Rerotate, capacity: int = 64):
        if sinks < 0 or window < 1:
            raise ValueError(f"a sink cache needs sinks >= 0 and window >= 1, got sinks={sinks}, window={window}")
        self.spec, self.sinks, self.window, self.rerotate = spec, sinks, window, rerotate
        # Bounded by sinks + window after each commit; one forward pass may add more before it.
        self.inner = ContiguousCache(spec, min(capacity, sinks + window), max_capacity=1 << 40)

    @classmethod
    def for_model(cls, config: ModelConfig, dtype: torch.dtype, sinks: int, window: int, rerotate: Rerotate) -> "SinkCache":
        native = [w for w in (config.window_for(i) for i in range(config.num_layers)) if w is not None]
        if native and sinks + window > min(native):
            raise ValueError(
                f"sinks + window ({sinks} + {window}) exceed this model's own sliding window ({min(native)}): "
                f"choose a window of at most {min(native) - sinks}"
            )
        return cls(CacheSpec.for_model(config, dtype), sinks, window, rerotate)

    @property
    def seq_len(self) -> int:
        return self.inner.seq_len

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    @property
    def positions_removed(self) -> int:
        return self.inner.positions_removed

    @property
    def tokens_seen(self) -> int:
        return self.seq_len + self.positions_removed

    def attention_span(self, layer: int, model_window: int | None) -> AttentionSpan:
        return AttentionSpan(self.window, self.sinks).narrowed(model_window)

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.update(layer, keys, values)

    def commit(self, num_tokens: int) -> None:
        self.inner.commit(num_tokens)
        excess = self.inner.seq_len - (self.sinks + self.window - 1)
        if excess > 0:
            self.inner.remove_range(self.sinks, self.sinks + excess, self.rerotate)

    def can_resume(self, num_tokens: int) -> bool:
        return num_tokens == self.seq_len or (self.positions_removed == 0 and 0 <= num_tokens <= self.seq_len)

    def truncate(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.seq_len:
            raise ValueError(f"cannot truncate to {num_tokens}: the cache holds {self.seq_len} positions")
        if not self.can_resume(num_tokens):
            raise ValueError(
                f"cannot rewind a sink cache to {num_tokens}: {self.positions_removed} positions were evicted, so "
                "its positions no longer match the text; recompute from scratch"
            )
        self.inner.truncate(num_tokens)

    def reset(self) -> None:
        self.inner.truncate(0)

    def remove_range(self, start: int, end: int, rerotate: Rerotate) -> None:
        self.inner.remove_range(start, end, rerotate)

    def copy_prefix(self, source: KVCache, num_tokens: int) -> None:
        self._check_copy_source(source, num_tokens)
        assert isinstance(source, SinkCache)
        if (source.sinks, source.window) != (self.sinks, self.window):
            raise ValueError(f"copy_prefix between sink caches needs the same sinks and window, got "
                             f"{source.sinks}+{source.window} into {self.sinks}+{self.window}")  # fmt: skip
        self.inner.copy_prefix(source.inner, num_tokens)

    def fork(self) -> "SinkCache":
        twin = SinkCache.__new__(SinkCache)
        twin.spec, twin.sinks, twin.window, twin.rerotate = self.spec, self.sinks, self.window, self.rerotate
        twin.inner = self.inner.fork()
        return twin

    def memory_bytes(self) -> int:
        return self.inner.memory_bytes()

    def check_invariants(self) -> None:
        self.inner.check_invariants()
        assert self.seq_len < self.sinks + self.window, f"{self.seq_len} positions held past sinks + window - 1"
