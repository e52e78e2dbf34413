"""TracingCache: wraps any cache and records every operation on it, for debugging and tests.

    cache = TracingCache(ContiguousCache(spec, 64))
    ... generate ...
    print(cache.summary())        # {'update': 60, 'commit': 2, ...}
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from kvgen.kv.interface import AttentionSpan, KVCache, KVLayout, Rerotate


@dataclass(frozen=True)
class CacheOp:
    name: str  # update, commit, truncate, fork, reset, kernel_layout, remove_range, copy_prefix
    layer: int | None = None
    num_tokens: int | None = None  # positions written / committed / kept
    seq_len_before: int = 0


class TracingCache(KVCache):
    def __init__(self, inner: KVCache, max_ops: int = 100_000):
        self.inner = inner
        self.spec = inner.spec
        self.ops: list[CacheOp] = []
        self.max_ops = max_ops  # a long generation must not grow the log without bound

    def _record(self, name: str, layer: int | None = None, num_tokens: int | None = None) -> None:
        if len(self.ops) < self.max_ops:
            self.ops.append(CacheOp(name, layer, num_tokens, self.inner.seq_len))

    def summary(self) -> dict[str, int]:
        return dict(Counter(op.name for op in self.ops))

    @property
    def seq_len(self) -> int:
        return self.inner.seq_len

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    def visible_start(self, layer: int) -> int:
        return self.inner.visible_start(layer)

    def attention_span(self, layer: int, model_window: int | None) -> AttentionSpan:
        return self.inner.attention_span(layer, model_window)

    @property
    def positions_removed(self) -> int:
        return self.inner.positions_removed

    def can_resume(self, num_tokens: int) -> bool:
        return self.inner.can_resume(num_tokens)

    def remove_range(self, start: int, end: int, rerotate: Rerotate) -> None:
        self._record("remove_range", num_tokens=end - start)
        self.inner.remove_range(start, end, rerotate)

    def removable_range(self, start: int, end: int) -> tuple[int, int]:
        return self.inner.removable_range(start, end)

    def copy_prefix(self, source: KVCache, num_tokens: int) -> None:
        self._record("copy_prefix", num_tokens=num_tokens)
        self.inner.copy_prefix(source.inner if isinstance(source, TracingCache) else source, num_tokens)

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._record("update", layer, keys.shape[2])
        return self.inner.update(layer, keys, values)

    def commit(self, num_tokens: int) -> None:
        self._record("commit", num_tokens=num_tokens)
        self.inner.commit(num_tokens)

    def truncate(self, num_tokens: int) -> None:
        self._record("truncate", num_tokens=num_tokens)
        self.inner.truncate(num_tokens)

    def reset(self) -> None:
        self._record("reset")
        self.inner.reset()

    def fork(self) -> "TracingCache":
        self._record("fork")
        return TracingCache(self.inner.fork(), self.max_ops)

    def kernel_layout(self, num_tokens: int) -> KVLayout | None:
        self._record("kernel_layout", num_tokens=num_tokens)
        return self.inner.kernel_layout(num_tokens)

    def memory_bytes(self) -> int:
        return self.inner.memory_bytes()

    def check_invariants(self) -> None:
        self.inner.check_invariants()
