"""CompressedCache: recent positions exact, older ones mean-pooled one slot per chunk of positions.

Slots per layer, in order: the first `sink` positions exact (attention sinks: they take most of the
attention mass and must not be averaged away), then one pooled slot per complete chunk of `chunk`
positions that has left the exact window (its mean key and mean value), then the last positions
exact. A chunk is pooled in `commit` once all of it is older than the last `window` positions;
pooling is never undone.

Masks: pooled and sink slots all hold positions older than any query of the next forward pass, so
the returned keys are read in a *virtual frame*: `visible_start` is seq_len minus the slots held, so
every exact slot keeps its real position and the pooled slots fall just before the exact ones. The
model's causal mask then allows every pooled slot and stays causal over the exact ones.

Softmax mass: a pooled slot stands for `chunk` positions, so `key_bias()` gives it an additive
log(chunk) (exp(q.k_mean) * chunk approximates the sum of the chunk's exp(q.k_i)); measured on
SmolLM2 in docs/kv-caches.md, and on by default because it was better.

Lossy truncate, the rule: truncating to n keeps positions < n exactly when n is at or after the
first exact position, or at a chunk boundary inside the pooled region (the pooled chunks before n
stay pooled: their positions are not restored, so what follows differs from a fresh run that still
held them exact). Truncating to the middle of a pooled chunk raises: that chunk's positions cannot
be recovered; `truncation_point(n)` gives the largest length <= n that can be kept.

remove_range, the rule: it drops whole slots only, so it is exact for what the cache holds (the
removed positions are gone, every other slot keeps its value; a pooled slot's mean key is turned
like its positions: RoPE is linear, so the turned mean is the mean of the turned keys). Allowed:
any range in the exact positions (sinks with nothing pooled, or the recent window); a range whose
ends fall on chunk boundaries in the pooled region (the chunks it covers are removed whole); a
range that starts in the sinks only when it also removes every pooled chunk (a sink cannot be
refilled from a pooled chunk). Anything else raises ValueError; `removable_range(start, end)` gives
the smallest range around it that can be removed.
"""

from __future__ import annotations

import math

import torch

from kvgen.kv.interface import CacheSpec, KVCache, Rerotate


class CompressedCache(KVCache):
    def __init__(self, spec: CacheSpec, chunk: int = 8, window: int = 64, sink: int = 4, bias: bool = True, capacity: int = 64):
        if chunk < 2 or window < 0 or sink < 0:
            raise ValueError(f"need chunk >= 2, window >= 0, sink >= 0; got chunk={chunk}, window={window}, sink={sink}")
        self.spec, self.chunk, self.window, self.sink, self.bias = spec, chunk, window, sink, bias
        shape = (spec.num_layers, 1, spec.num_kv_heads, max(capacity, 1), spec.head_dim)
        self._keys = torch.zeros(shape, dtype=spec.dtype)  # [L, 1, H, slots, D]
        self._values = torch.zeros(shape, dtype=spec.dtype)
        self._seq_len = 0
        self._pooled = 0  # chunks pooled, covering positions sink .. pool_end
        self._removed = 0  # positions dropped by remove_range since the cache was last empty

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def num_pooled(self) -> int:
        return self._pooled

    @property
    def pool_end(self) -> int:
        """First position held exactly after the sinks (== sink while nothing is pooled)."""
        return self.sink + self._pooled * self.chunk

    def num_slots(self, num_positions: int) -> int:
        """Slots that positions 0..num_positions-1 occupy now (num_positions >= pool_end)."""
        return num_positions - self._pooled * (self.chunk - 1)

    @property
    def capacity(self) -> int:
        return self._keys.shape[3] + self._pooled * (self.chunk - 1)

    def visible_start(self, layer: int) -> int:
        return self._pooled * (self.chunk - 1)

    def key_bias(self) -> torch.Tensor | None:
        if not self.bias or self._pooled == 0:
            return None
        bias = torch.zeros(min(self._seq_len, self.sink) + self._pooled)
        bias[self.sink :] = math.log(self.chunk)
        return bias

    def _reserve(self, num_slots: int) -> None:
        if num_slots <= self._keys.shape[3]:
            return
        grown_slots = max(num_slots, 2 * self._keys.shape[3])
        used = self.num_slots(self._seq_len)
        for name in ("_keys", "_values"):
            old = getattr(self, name)
            grown = torch.zeros((*old.shape[:3], grown_slots, old.shape[4]), dtype=old.dtype)
            grown[:, :, :, :used] = old[:, :, :, :used]
            setattr(self, name, grown)

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.num_slots(self._seq_len)
        end = start + keys.shape[2]
        self._reserve(end)
        self._keys[layer, :, :, start:end] = keys
        self._values[layer, :, :, start:end] = values
        return self._keys[layer, :, :, :end], self._values[layer, :, :, :end]

    def commit(self, num_tokens: int) -> None:
        self._seq_len += num_tokens
        poolable = max(0, (self._seq_len - self.window - self.sink) // self.chunk)
        if poolable > self._pooled:
            self._pool(poolable)

    def _pool(self, target: int) -> None:
        """Replace exact chunks _pooled..target-1 by their means and move the exact rest down."""
        first = self.sink + self._pooled  # slot of the first chunk to pool (it is held exactly)
        new_chunks = target - self._pooled
        exact_from, exact_to = first + new_chunks * self.chunk, self.num_slots(self._seq_len)
        for name in ("_keys", "_values"):
            store = getattr(self, name)  # [L, 1, H, slots, D]
            chunks = store[:, :, :, first:exact_from].unflatten(3, (new_chunks, self.chunk))  # [L, 1, H, n, chunk, D]
            means = chunks.mean(dim=4)
            rest = store[:, :, :, exact_from:exact_to].clone()
            store[:, :, :, first : first + new_chunks] = means
            store[:, :, :, first + new_chunks : first + new_chunks + rest.shape[3]] = rest
        self._pooled = target

    def truncation_point(self, num_tokens: int) -> int:
        """The largest length <= num_tokens this cache can truncate to exactly."""
        if num_tokens >= self.pool_end or num_tokens <= self.sink:
            return num_tokens
        return num_tokens - (num_tokens - self.sink) % self.chunk

    def can_resume(self, num_tokens: int) -> bool:
        """True where `truncate(num_tokens)` is allowed (the rule above; pooled chunks before it stay pooled)."""
        return 0 <= num_tokens <= self._seq_len and self.truncation_point(num_tokens) == num_tokens

    def copy_prefix(self, source: KVCache, num_tokens: int) -> None:
        self._check_copy_source(source, num_tokens)
        twin = source.fork()
        twin.truncate(num_tokens)
        self.chunk, self.window, self.sink, self.bias = twin.chunk, twin.window, twin.sink, twin.bias
        self._keys, self._values, self._seq_len, self._pooled = twin._keys, twin._values, twin._seq_len, twin._pooled
        self._removed = source.positions_removed if num_tokens == source.seq_len else 0  # as ContiguousCache

    def truncate(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._seq_len:
            raise ValueError(f"cannot truncate to {num_tokens}: the cache holds {self._seq_len} positions")
        point = self.truncation_point(num_tokens)
        if point != num_tokens:
            raise ValueError(
                f"cannot truncate to {num_tokens}: positions {point}..{point + self.chunk - 1} were pooled into one "
                f"slot and cannot be restored; truncate to {point} (truncation_point) and recompute from there"
            )
        if num_tokens < self.pool_end:
            self._pooled = max(0, num_tokens - self.sink) // self.chunk
        self._seq_len = num_tokens
        self._removed = self._removed if num_tokens else 0

    def reset(self) -> None:
        self._seq_len, self._pooled, self._removed = 0, 0, 0

    @property
    def positions_removed(self) -> int:
        return self._removed

    def removable_range(self, start: int, end: int) -> tuple[int, int]:
        """The smallest range around start..end-1 that remove_range can drop (the rule above); the
        generation loop's context shift widens its range to it."""
        if start == end:
            return start, end
        if self.sink < start < self.pool_end:
            start -= (start - self.sink) % self.chunk  # back to its chunk's first position
        if self.sink < end < self.pool_end:
            end += -(end - self.sink) % self.chunk  # on to the end of its chunk
        if self._pooled and start < self.sink and end < self.pool_end:  # no sink is refilled from a pooled chunk
            end = self.pool_end
        return start, end

    def _slot(self, position: int) -> int:
        """Slot where `position` starts (a sink, a chunk boundary or an exact position)."""
        if position <= self.sink:
            return position
        if position < self.pool_end:
            return self.sink + (position - self.sink) // self.chunk
        return self.num_slots(position)

    def remove_range(self, start: int, end: int, rerotate: Rerotate) -> None:
        """Drop positions start..end-1 when they are whole slots (see the rule in the module doc);
        the later slots move back, their keys (pooled means too) turned by -(end - start)."""
        if not 0 <= start <= end <= self._seq_len:
            raise ValueError(f"cannot remove positions {start}..{end}: the cache holds {self._seq_len}")
        if start == end:
            return
        widest = self.removable_range(start, end)
        if widest != (start, end):
            pooled = f"positions {self.sink}..{self.pool_end - 1} are pooled in chunks of {self.chunk}, each removed whole"
            why = f"the sinks 0..{self.sink - 1} cannot be refilled from pooled chunks" if start < self.sink else pooled
            raise ValueError(
                f"cannot remove positions {start}..{end} exactly: {why}; remove {widest[0]}..{widest[1]} "
                "(removable_range) instead, or recompute the shortened text"
            )
        removed, first, last, used = end - start, self._slot(start), self._slot(end), self.num_slots(self._seq_len)
        for layer in range(self.spec.num_layers):
            keys = self._keys[layer, :, :, last:used].clone()
            self._keys[layer, :, :, first : first + used - last] = rerotate(layer, keys, -removed)
            self._values[layer, :, :, first : first + used - last] = self._values[layer, :, :, last:used].clone()
        self._pooled -= max(0, min(end, self.pool_end) - max(start, self.sink)) // self.chunk
        self._seq_len -= removed
        self._removed += removed

    def fork(self) -> "CompressedCache":
        twin = CompressedCache(self.spec, self.chunk, self.window, self.sink, self.bias, capacity=1)
        used = self.num_slots(self._seq_len)
        twin._keys = self._keys.clone() if used else twin._keys
        twin._values = self._values.clone() if used else twin._values
        twin._seq_len, twin._pooled, twin._removed = self._seq_len, self._pooled, self._removed
        return twin

    def memory_bytes(self) -> int:
        return self._keys.numel() * self._keys.element_size() * 2

    def check_invariants(self) -> None:
        super().check_invariants()
        assert self._pooled >= 0, "negative pooled count"
        if self._pooled:
            assert self.pool_end <= self._seq_len, f"pooled up to {self.pool_end} past seq_len {self._seq_len}"
        assert self.num_slots(self._seq_len) <= self._keys.shape[3], "more slots than storage"
        bias = self.key_bias()
        assert bias is None or bias.shape[0] == min(self._seq_len, self.sink) + self._pooled, "bias length"
