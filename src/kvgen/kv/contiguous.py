"""Contiguous cache: one preallocated buffer per K and V, written in place, read as zero-copy views
(one buffer for both where the spec's values are its keys: DeepSeek's latent attention)."""

from __future__ import annotations

import torch

from kvgen.kv import huge_pages
from kvgen.kv.interface import CacheSpec, KVCache, KVLayout, Rerotate


class ContiguousCache(KVCache):
    """Buffers [layers, batch, kv_heads, capacity, head_dim]; `update` writes a slice, returns a view.

    No allocation per token. When a sequence outgrows the buffer (a long chat session) it doubles, so
    the history is copied O(log n) times in total, never per step. `max_capacity` (the model's
    context) bounds the growth.
    """

    def __init__(
        self, spec: CacheSpec, capacity: int, batch_size: int = 1, max_capacity: int | None = None,
        device: torch.device | str = "cpu",
    ):  # fmt: skip
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.spec = spec
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.max_capacity = max_capacity if max_capacity is not None else capacity
        self._seq_len = 0
        self._removed = 0  # positions dropped by remove_range since the cache was last empty
        self._keys, self._values = self._new_buffers(min(capacity, self.max_capacity))  # [L, B, H, C, D] each
        self._tail_zeroed = self.device.type != "cpu" or batch_size > 1  # positions never written read as 0

    def _new_buffers(self, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values for `capacity` positions. One sequence only reads positions it wrote, so
        its buffers skip zero-filling (a 512-token SmolLM2 prefill spent 4% of its time there).
        Batched rows are zeroed: a shorter row's padding positions are read under a mask, and
        uninitialised memory could hold NaN (0 * NaN = NaN). So is a GPU cache, whose CUDA graphs
        attend over a fixed bucket of positions under a mask (models/cuda_graphs.py); its keys and
        values are one allocation, so a later cache of the same size gets back the same address
        (and the graphs captured over it). CPU buffers ask for huge pages (kv/huge_pages.py)."""
        spec = self.spec
        shape = (spec.num_layers, self.batch_size, spec.num_kv_heads, capacity, spec.head_dim)
        stores = 1 if spec.values_are_keys else 2
        if self.device.type != "cpu":
            both = torch.zeros((stores, *shape), dtype=spec.dtype, device=self.device)
            return both[0], both[stores - 1]
        new = huge_pages.empty if self.batch_size == 1 else huge_pages.zeros
        keys = new(shape, spec.dtype)
        return keys, keys if spec.values_are_keys else new(shape, spec.dtype)

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def capacity(self) -> int:
        return self._keys.shape[3]

    def reserve(self, num_tokens: int) -> None:
        """Make room for `num_tokens` positions in total (doubling, bounded by max_capacity)."""
        if num_tokens <= self.capacity:
            return
        if num_tokens > self.max_capacity:
            raise ValueError(f"cache needs {num_tokens} positions but is limited to {self.max_capacity}")
        new_capacity = min(max(num_tokens, 2 * self.capacity), self.max_capacity)
        keys, values = self._new_buffers(new_capacity)
        keys[:, :, :, : self._seq_len] = self._keys[:, :, :, : self._seq_len]
        if not self.spec.values_are_keys:
            values[:, :, :, : self._seq_len] = self._values[:, :, :, : self._seq_len]
        self._keys, self._values = keys, values
        self._tail_zeroed = self.device.type != "cpu" or self.batch_size > 1

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start, end = self._seq_len, self._seq_len + keys.shape[2]
        self.reserve(end)
        self._keys[layer, :, :, start:end] = keys
        if not self.spec.values_are_keys:
            self._values[layer, :, :, start:end] = values
        return self._keys[layer, :, :, :end], self._values[layer, :, :, :end]

    def copy_positions(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of every layer's keys and values at positions start..end-1: [L, B, H, n, D] each
        (one tensor twice where values are keys)."""
        if not 0 <= start <= end <= self._seq_len:
            raise ValueError(f"cannot copy positions {start}..{end}: the cache holds {self._seq_len}")
        keys = self._keys[:, :, :, start:end].clone()
        return keys, keys if self.spec.values_are_keys else self._values[:, :, :, start:end].clone()

    def kernel_layout(self, num_tokens: int) -> KVLayout | None:
        if self.spec.dtype != torch.float32 or self.batch_size != 1:
            return None
        self.reserve(num_tokens)
        k = self._keys  # [L, 1, H, C, D]
        return KVLayout(self._keys, self._values, k.stride(0), k.stride(2), k.stride(3))

    def release(self) -> None:
        """A GPU cache hands its memory back at once (not when the last reference goes), so the next
        request of the same size is given the same buffers. Reusable: it grows again on demand."""
        super().release()
        if self.device.type != "cpu":
            self._keys, self._values = self._new_buffers(0)

    def static_buffers(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.batch_size != 1 or num_tokens > self.max_capacity:
            return None
        self.reserve(num_tokens)
        if not self._tail_zeroed:  # a graph attends over unwritten positions under a mask: 0 * NaN is NaN
            self._keys[:, :, :, self._seq_len :].zero_()
            if not self.spec.values_are_keys:
                self._values[:, :, :, self._seq_len :].zero_()
            self._tail_zeroed = True
        return self._keys, self._values

    def commit(self, num_tokens: int) -> None:
        if self._seq_len + num_tokens > self.capacity:
            raise AssertionError(f"commit of {num_tokens} past capacity {self.capacity} at {self._seq_len}")
        self._seq_len += num_tokens

    def truncate(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._seq_len:
            raise ValueError(f"cannot truncate to {num_tokens}: the cache holds {self._seq_len} positions")
        self._seq_len = num_tokens
        if num_tokens == 0:
            self._removed = 0

    @property
    def positions_removed(self) -> int:
        return self._removed

    def remove_range(self, start: int, end: int, rerotate: Rerotate) -> None:
        if not 0 <= start <= end <= self._seq_len:
            raise ValueError(f"cannot remove positions {start}..{end}: the cache holds {self._seq_len}")
        removed, tail = end - start, slice(end, self._seq_len)
        moved = slice(start, self._seq_len - removed)
        for layer in range(self.spec.num_layers):
            keys = self._keys[layer, :, :, tail].clone()
            self._keys[layer, :, :, moved] = rerotate(layer, keys, -removed) if removed else keys
            if not self.spec.values_are_keys:
                self._values[layer, :, :, moved] = self._values[layer, :, :, tail].clone()
        self._seq_len -= removed
        self._removed += removed

    def copy_prefix(self, source: KVCache, num_tokens: int) -> None:
        self._check_copy_source(source, num_tokens)
        assert isinstance(source, ContiguousCache)
        if source.batch_size != self.batch_size:
            raise ValueError(f"cannot copy a batch of {source.batch_size} into a cache of batch {self.batch_size}")
        self.reserve(num_tokens)
        self._keys[:, :, :, :num_tokens] = source._keys[:, :, :, :num_tokens]
        if not self.spec.values_are_keys:
            self._values[:, :, :, :num_tokens] = source._values[:, :, :, :num_tokens]
        self._seq_len, self._removed = num_tokens, source._removed if num_tokens == source.seq_len else 0

    def fork(self) -> "ContiguousCache":
        # Contiguous storage cannot share pages: a fork copies the used part only.
        twin = ContiguousCache(self.spec, max(self._seq_len, 1), self.batch_size, self.max_capacity, self.device)
        twin.reserve(self.capacity)
        twin._keys[:, :, :, : self._seq_len] = self._keys[:, :, :, : self._seq_len]
        if not self.spec.values_are_keys:
            twin._values[:, :, :, : self._seq_len] = self._values[:, :, :, : self._seq_len]
        twin._seq_len, twin._removed = self._seq_len, self._removed
        return twin

    def memory_bytes(self) -> int:
        return self._keys.numel() * self._keys.element_size() * (1 if self.spec.values_are_keys else 2)
