"""WindowedCache: sliding-window layers keep only the positions their queries can still see.

For a layer with window W, a query at position p attends to positions p-W+1..p, so once a forward
pass is committed everything older than the last W-1 positions is dead. Full-attention layers keep
everything. Old positions are dropped in `commit`, never inside a forward pass (the model builds its
masks from `visible_start` before the blocks run), and in amortized steps: the last W-1 positions
are copied to the front only when the buffer holds 2W, so there is no per-token copy.

Rewinding (truncate) is exact while the positions the new end needs are still held; otherwise it
raises, since dropped keys cannot be recomputed from the cache alone.
"""

from __future__ import annotations

import torch

from kvgen.config import ModelConfig
from kvgen.kv.interface import CacheSpec, KVCache


class _Layer:
    """One layer's keys/values [1, H, capacity, D]; position `base + i` lives at index i."""

    def __init__(self, spec: CacheSpec, capacity: int, window: int | None):
        shape = (1, spec.num_kv_heads, capacity, spec.head_dim)
        self.keys, self.values = torch.zeros(shape, dtype=spec.dtype), torch.zeros(shape, dtype=spec.dtype)
        self.window, self.base = window, 0

    def ensure(self, num_held: int) -> None:
        if num_held <= self.keys.shape[2]:
            return
        capacity = max(num_held, 2 * self.keys.shape[2])
        for name in ("keys", "values"):
            old = getattr(self, name)
            grown = torch.zeros((*old.shape[:2], capacity, old.shape[3]), dtype=old.dtype)
            grown[:, :, : old.shape[2]] = old
            setattr(self, name, grown)

    def drop_dead(self, seq_len: int) -> None:
        """Keep the last window-1 positions once 2*window are held (amortized O(1) per token), in a
        buffer of 2*window (a long prefill may have grown it)."""
        if self.window is None or seq_len - self.base < 2 * self.window:
            return
        keep, start = self.window - 1, seq_len - self.base - (self.window - 1)
        for name in ("keys", "values"):
            old = getattr(self, name)
            fresh = torch.zeros((*old.shape[:2], 2 * self.window, old.shape[3]), dtype=old.dtype)
            fresh[:, :, :keep] = old[:, :, start : start + keep]
            setattr(self, name, fresh)
        self.base = seq_len - keep


class WindowedCache(KVCache):
    def __init__(self, spec: CacheSpec, windows: list[int | None], capacity: int = 64):
        assert len(windows) == spec.num_layers
        self.spec = spec
        self.layers = [_Layer(spec, min(capacity, 2 * w) if w else capacity, w) for w in windows]
        self._seq_len = 0

    @classmethod
    def for_model(cls, config: ModelConfig, dtype: torch.dtype, capacity: int) -> "WindowedCache":
        return cls(CacheSpec.for_model(config, dtype), [config.window_for(i) for i in range(config.num_layers)], capacity)

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def capacity(self) -> int:
        return self._seq_len + min(layer.keys.shape[2] - (self._seq_len - layer.base) for layer in self.layers)

    def visible_start(self, layer: int) -> int:
        return self.layers[layer].base

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        held = self.layers[layer]
        start = self._seq_len - held.base
        end = start + keys.shape[2]
        held.ensure(end)
        held.keys[:, :, start:end] = keys
        held.values[:, :, start:end] = values
        return held.keys[:, :, :end], held.values[:, :, :end]

    def commit(self, num_tokens: int) -> None:
        self._seq_len += num_tokens
        for held in self.layers:
            held.drop_dead(self._seq_len)

    def can_truncate(self, num_tokens: int) -> bool:
        """Whether every layer still holds what a query at position `num_tokens` needs."""
        return all(h.window is None and h.base == 0 or h.base <= max(0, num_tokens - (h.window or 0) + 1)
                   for h in self.layers)  # fmt: skip

    def truncate(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._seq_len:
            raise ValueError(f"cannot truncate to {num_tokens}: the cache holds {self._seq_len} positions")
        if not self.can_truncate(num_tokens):
            oldest = max(h.base for h in self.layers)
            raise ValueError(
                f"cannot rewind a sliding-window cache to {num_tokens}: positions before {oldest} were dropped; "
                "recompute the prompt from scratch"
            )
        self._seq_len = num_tokens

    def reset(self) -> None:
        """Empty (always allowed, unlike a rewind behind dropped positions)."""
        self._seq_len = 0
        for held in self.layers:
            held.base = 0

    def fork(self) -> "WindowedCache":
        twin = WindowedCache.__new__(WindowedCache)
        twin.spec, twin._seq_len = self.spec, self._seq_len
        twin.layers = []
        for held in self.layers:
            copy = _Layer.__new__(_Layer)
            copy.keys, copy.values = held.keys.clone(), held.values.clone()
            copy.window, copy.base = held.window, held.base
            twin.layers.append(copy)
        return twin

    def memory_bytes(self) -> int:
        return sum(h.keys.numel() * h.keys.element_size() * 2 for h in self.layers)

    def check_invariants(self) -> None:
        assert self._seq_len >= 0
        for i, held in enumerate(self.layers):
            assert 0 <= held.base <= self._seq_len <= held.base + held.keys.shape[2], f"layer {i} out of range"
            if held.window is not None:
                assert self._seq_len - held.base < 2 * held.window or self._seq_len < 2 * held.window, f"layer {i} kept too much"
