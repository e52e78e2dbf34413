"""WindowedCache: each layer keeps only the positions its queries can still see.

A layer's rule is an AttentionSpan: a sliding window W (a query at p sees p-W+1..p; Gemma 3's local
layers, or a window imposed on every layer), chunked attention C (a query sees only its own chunk of
C positions, Llama 4 style), or None (full attention: keep everything). `extra` keeps that many
older positions beyond what the rule needs, so rewinding up to `extra` tokens stays exact (window
plus extra memory).

Old positions are dropped in `commit`, never inside a forward pass (the model builds its masks from
`visible_start` before the blocks run), and in amortized steps: a layer copies what it still needs
to the front only once it holds 2 x (span + extra) positions, so there is no per-token copy.
Rewinding (truncate) is exact while the positions the new end needs are still held; otherwise it
raises, since dropped keys cannot be recomputed from the cache alone.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvgen.config import ModelConfig
from kvgen.kv.interface import AttentionSpan, CacheSpec, KVCache, Rerotate


class _Layer:
    """One layer's keys/values [1, H, buffer, D]; position `base + i` lives at index i."""

    def __init__(self, spec: CacheSpec, capacity: int, span: AttentionSpan | None, extra: int):
        self.span, self.extra, self.base = span, extra, 0
        self.limit = None if span is None else 2 * (min(s for s in (span.window, span.chunk) if s) + extra)
        shape = (1, spec.num_kv_heads, min(capacity, self.limit or capacity), spec.head_dim)
        self.keys, self.values = torch.zeros(shape, dtype=spec.dtype), torch.zeros(shape, dtype=spec.dtype)

    def clone(self) -> "_Layer":
        twin = _Layer.__new__(_Layer)
        twin.__dict__.update(self.__dict__)
        twin.keys, twin.values = self.keys.clone(), self.values.clone()
        return twin

    def ensure(self, num_held: int) -> None:
        if num_held > self.keys.shape[2]:
            self._move(0, self.keys.shape[2], max(num_held, 2 * self.keys.shape[2]))

    def _move(self, start: int, count: int, size: int) -> None:
        """Buffers of `size` positions holding indices start..start+count-1 of the old ones."""
        for name in ("keys", "values"):
            old = getattr(self, name)
            fresh = torch.zeros((*old.shape[:2], size, old.shape[3]), dtype=old.dtype)
            fresh[:, :, :count] = old[:, :, start : start + count]
            setattr(self, name, fresh)

    def first_needed(self, position: int) -> int:
        return 0 if self.span is None else self.span.first_needed(position)

    def drop_dead(self, seq_len: int) -> None:
        """Once `limit` positions are held, keep only what the next query needs plus `extra`."""
        if self.limit is None or seq_len - self.base < self.limit:
            return
        keep_from = max(self.base, self.first_needed(max(0, seq_len - self.extra)))  # what a rewind of `extra` needs
        self._move(keep_from - self.base, seq_len - keep_from, max(self.limit, seq_len - keep_from))
        self.base = keep_from

    def remove(self, start: int, end: int, seq_len: int, rerotate: Rerotate, layer: int) -> None:
        """Drop positions start..end-1 (those still held); held positions from `end` on move back."""
        removed, held = end - start, seq_len - self.base
        first_moved = max(end, self.base) - self.base  # index of the first held position that moves
        dest = max(start, self.base) - self.base
        count = held - first_moved
        keys = self.keys[:, :, first_moved:held].clone()
        self.keys[:, :, dest : dest + count] = rerotate(layer, keys, -removed)
        self.values[:, :, dest : dest + count] = self.values[:, :, first_moved:held].clone()
        self.base = self.base if self.base <= start else max(start, self.base - removed)


class WindowedCache(KVCache):
    def __init__(
        self, spec: CacheSpec, rules: Sequence[int | AttentionSpan | None], capacity: int = 64, extra: int = 0
    ):  # fmt: skip
        """rules: per layer, a window size, an AttentionSpan (window and/or chunk) or None (full)."""
        if len(rules) != spec.num_layers:
            raise ValueError(f"{len(rules)} layer rules for {spec.num_layers} layers")
        if extra < 0:
            raise ValueError(f"extra must be >= 0, got {extra}")
        spans = [AttentionSpan(rule) if isinstance(rule, int) else rule for rule in rules]
        if any(s is not None and s.sinks for s in spans):
            raise ValueError("a WindowedCache does not keep sinks: use SinkCache (kv/sinks.py)")
        self.spec, self.extra = spec, extra
        self.layers = [_Layer(spec, capacity, span, extra) for span in spans]
        self._seq_len = self._removed = 0

    @classmethod
    def for_model(
        cls, config: ModelConfig, dtype: torch.dtype, capacity: int,
        window: int | None = None, chunk: int | None = None, extra: int = 0,
    ) -> "WindowedCache":  # fmt: skip
        """The model's own sliding windows, narrowed by `window` and/or `chunk` on every layer."""
        rules: list[AttentionSpan | None] = []
        for layer in range(config.num_layers):
            native = config.window_for(layer)
            span = AttentionSpan(window, chunk=chunk).narrowed(native)
            rules.append(span if span.window or span.chunk else None)
        return cls(CacheSpec.for_model(config, dtype), rules, capacity, extra)

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def capacity(self) -> int:
        return self._seq_len + min(layer.keys.shape[2] - (self._seq_len - layer.base) for layer in self.layers)

    @property
    def positions_removed(self) -> int:
        return self._removed

    def visible_start(self, layer: int) -> int:
        return self.layers[layer].base

    def attention_span(self, layer: int, model_window: int | None) -> AttentionSpan:
        span = self.layers[layer].span
        return AttentionSpan(model_window) if span is None else span.narrowed(model_window)

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

    def can_resume(self, num_tokens: int) -> bool:
        """Whether every layer still holds what a query at position `num_tokens` needs."""
        return 0 <= num_tokens <= self._seq_len and all(h.base <= h.first_needed(num_tokens) for h in self.layers)

    can_truncate = can_resume  # the name this cache first had

    def truncate(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._seq_len:
            raise ValueError(f"cannot truncate to {num_tokens}: the cache holds {self._seq_len} positions")
        if not self.can_resume(num_tokens):
            oldest = max(h.base for h in self.layers)
            raise ValueError(
                f"cannot rewind a windowed cache to {num_tokens}: positions before {oldest} were dropped; "
                "recompute the prompt from scratch (or keep more with extra memory)"
            )
        self._seq_len = num_tokens
        self._removed = self._removed if num_tokens else 0

    def reset(self) -> None:
        """Empty (always allowed, unlike a rewind behind dropped positions)."""
        self._seq_len = self._removed = 0
        for held in self.layers:
            held.base = 0

    def remove_range(self, start: int, end: int, rerotate: Rerotate) -> None:
        """As ContiguousCache.remove_range, on the positions each layer still holds (a layer whose
        window already dropped part of the range just has less to remove)."""
        if not 0 <= start <= end <= self._seq_len:
            raise ValueError(f"cannot remove positions {start}..{end}: the cache holds {self._seq_len}")
        if start == end:
            return
        for layer, held in enumerate(self.layers):
            held.remove(start, end, self._seq_len, rerotate, layer)
        self._seq_len -= end - start
        self._removed += end - start

    def copy_prefix(self, source: KVCache, num_tokens: int) -> None:
        self._check_copy_source(source, num_tokens)
        twin = source.fork()
        twin.truncate(num_tokens)
        assert isinstance(twin, WindowedCache)
        self.layers, self.extra, self._seq_len = twin.layers, twin.extra, num_tokens
        self._removed = twin._removed

    def fork(self) -> "WindowedCache":
        twin = WindowedCache.__new__(WindowedCache)
        twin.spec, twin.extra, twin._seq_len, twin._removed = self.spec, self.extra, self._seq_len, self._removed
        twin.layers = [held.clone() for held in self.layers]
        return twin

    def memory_bytes(self) -> int:
        return sum(h.keys.numel() * h.keys.element_size() * 2 for h in self.layers)

    def check_invariants(self) -> None:
        assert self._seq_len >= 0
        for i, held in enumerate(self.layers):
            assert 0 <= held.base <= self._seq_len <= held.base + held.keys.shape[2], f"layer {i} out of range"
            if held.limit is not None:
                assert self._seq_len - held.base < held.limit, f"layer {i} holds {self._seq_len - held.base} >= {held.limit}"
            else:
                assert held.base == 0, f"full-attention layer {i} dropped positions"
