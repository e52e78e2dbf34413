"""One batched read and write of a pool of K/V codes (kv/paged_codes.py) for a ragged batch.

The engine's rows all live in one QuantizedPagedStorage. Per layer, each row's new keys/values are
written (into its staged block's slot, or encoded when they fill a block whole), and attention runs
in place over the codes (kernels/paged_codes_attention.c): every row's full blocks are decoded a
tile at a time through its block table, and the rest of its positions, the staged start of its
current block plus this forward's new tokens, are one fp32 run. Decodes, prompt chunks and
speculative verifies alike: no step decodes a whole history. Without the C kernels, `update`
decodes each row's history for the torch path (the reference the kernel is tested against).
"""

from __future__ import annotations

import ctypes

import torch

from kvgen.kernels import load
from kvgen.kv.codes_layout import PackedCodes, describe, kernel_reads, rope_tables
from kvgen.kv.interface import AttentionSpan
from kvgen.kv.paged_codes import QuantizedPagedStorage


class StorageDescriptors:
    """Per layer, the kernels' view of a QuantizedPagedStorage's codes (its tensors never move)."""

    def __init__(self, storage: QuantizedPagedStorage, max_positions: int):
        rope = rope_tables(storage.key_rope, storage.spec.num_layers, max_positions) if storage.key_codec.keys_before_rope else None
        layers = range(storage.spec.num_layers)
        self.keys = (PackedCodes * len(layers))(*(describe(storage.key_store, i, rope[i] if rope else None) for i in layers))
        self.values = (PackedCodes * len(layers))(*(describe(storage.value_store, i, None) for i in layers))
        self._rope = rope  # the key descriptors point into these tables

    @staticmethod
    def for_storage(storage: QuantizedPagedStorage) -> "StorageDescriptors | None":
        spec = storage.spec
        if load() is None or not kernel_reads(storage.key_codec, storage.value_codec, spec.head_dim, storage.block_size):
            return None
        if storage.descriptors is None:
            storage.descriptors = StorageDescriptors(storage, storage.max_positions)
        return storage.descriptors


class QuantizedPagedBatchView:
    """Duck-types what Attention uses (`update`, `attend_in_place`) for rows over one code pool."""

    @staticmethod
    def applies(caches: list, cache_type: type) -> bool:
        """Every row a `cache_type` (kv/paged_codes_cache.py QuantizedPagedCache) over one storage."""
        return all(type(c) is cache_type for c in caches) and len({id(c.storage) for c in caches}) == 1

    def __init__(self, caches: list, lengths: list[int]):  # caches: QuantizedPagedCache rows
        self.storage = caches[0].storage
        self.caches, self.lengths = caches, lengths
        self.starts = [c.seq_len for c in caches]
        for cache, start, n in zip(caches, self.starts, lengths):
            cache._prepare_write(start, start + n)  # blocks, copy-on-write and staging once per forward
        size = self.storage.block_size
        coded = [start // size for start in self.starts]
        width = max(1, max(coded))
        self.tables = torch.tensor([[b.block_id for b in c.blocks[:n]] + [0] * (width - n) for c, n in zip(caches, coded)])
        self.num_code_blocks = torch.tensor(coded)
        self.q_counts, self.q_first = torch.tensor(lengths), torch.tensor(self.starts)
        self.descriptors = StorageDescriptors.for_storage(self.storage)
        self._slots: torch.Tensor | None = None

    def in_place_starts(self, lengths: list[int], spans: tuple[AttentionSpan, ...]) -> torch.Tensor | None:
        """The layer's window (0 = none) when attention can run in place over the codes: the
        kernels are built and read these codecs, and no row has sinks or chunks; else None."""
        if self.descriptors is None or any(s.sinks or s.chunk for s in spans) or len({s.window for s in spans}) != 1:
            return None
        return torch.tensor(spans[0].window or 0)

    def _write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        for i, (cache, start, n) in enumerate(zip(self.caches, self.starts, self.lengths)):
            self.storage.write(layer, cache.blocks, start, keys[i, :, :n], values[i, :, :n])

    def _recent(self, layer: int, row: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Row's fp32 run: the staged start of its current block, then its new tokens, [H, n, D]."""
        cache, start, n = self.caches[row], self.starts[row], self.lengths[row]
        size = self.storage.block_size
        prefix_k, prefix_v = self.storage.staged_prefix(layer, cache.blocks[start // size], start % size)
        if prefix_k.shape[1] == 0:
            return keys[row, :, :n].contiguous(), values[row, :, :n].contiguous()
        return torch.cat((prefix_k, keys[row, :, :n]), 1), torch.cat((prefix_v, values[row, :, :n]), 1)

    def attend_in_place(self, layer: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                        window: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Write the rows' new keys/values, then attention of q [B, H, S, D] over each row's codes
        and fp32 run, causal -> [B, H, S, D] (padded queries give zeros)."""
        assert self.descriptors is not None
        self._write(layer, keys, values)
        rows, heads, _, dim = q.shape
        recents = [self._recent(layer, r, keys, values) for r in range(rows)]
        row_index = torch.repeat_interleave(torch.arange(rows), self.q_counts)
        column = torch.cat([torch.arange(n) for n in self.lengths])
        queries = q.transpose(1, 2)[row_index, column].contiguous()  # [T, H, D]
        out = torch.empty_like(queries)
        addresses = torch.tensor([[k.data_ptr(), v.data_ptr(), k.stride(0)] for k, v in recents])  # [B, 3]
        recent_k, recent_v, strides = (addresses[:, i].contiguous() for i in range(3))
        load().kvgen_paged_codes_attention(
            queries.data_ptr(), out.data_ptr(), rows, self.q_counts.data_ptr(), self.q_first.data_ptr(), heads,
            keys.shape[1], dim, ctypes.c_float(scale), int(window), ctypes.byref(self.descriptors.keys[layer]),
            ctypes.byref(self.descriptors.values[layer]), self.storage.block_size, self.tables.data_ptr(),
            self.tables.shape[1], self.num_code_blocks.data_ptr(), recent_k.data_ptr(), recent_v.data_ptr(),
            strides.data_ptr(),
        )  # fmt: skip
        result = q.new_zeros(q.transpose(1, 2).shape)  # [B, S, H, D]
        result[row_index, column] = out
        return result.transpose(1, 2)

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch path: keys/values [B, H_kv, S_max, D] -> every row's keys/values so far,
        decoded, [B, H_kv, L_max, D] (zeros past a row's end: masked out)."""
        self._write(layer, keys, values)
        parts = []
        for row, (cache, start) in enumerate(zip(self.caches, self.starts)):
            old_k, old_v = cache.history(layer, start)
            n = self.lengths[row]
            parts.append((torch.cat((old_k, keys[row, :, :n]), 1), torch.cat((old_v, values[row, :, :n]), 1)))
        longest = max(k.shape[1] for k, _ in parts)
        out_k = keys.new_zeros((len(parts), keys.shape[1], longest, keys.shape[3]))
        out_v = torch.zeros_like(out_k)
        for row, (k, v) in enumerate(parts):
            out_k[row, :, : k.shape[1]], out_v[row, :, : v.shape[1]] = k, v
        return out_k, out_v

    def rows_kernel(self) -> tuple[str, tuple] | None:
        """For one-token rows, the C step over every layer (kernels/decode.c
        kvgen_decode_rows_over_codes) and its storage arguments; None without the kernels."""
        if self.descriptors is None or any(n != 1 for n in self.lengths):
            return None
        size, storage = self.storage.block_size, self.storage
        self._slots = torch.tensor([storage.slot_of[c.blocks[s // size].block_id] for c, s in zip(self.caches, self.starts)])
        if bool((self._slots < 0).any()):  # blocks of one position are encoded whole, never staged
            return None
        self._offsets = torch.tensor([s % size for s in self.starts])
        stage_k, stage_v = storage.stage_keys, storage.stage_values  # [L, slots, H, bs, D]
        return "kvgen_decode_rows_over_codes", (
            stage_k.data_ptr(), stage_v.data_ptr(), stage_k.stride(0), stage_k.stride(2), stage_k.stride(1), size,
            self._slots.data_ptr(), self._offsets.data_ptr(), ctypes.byref(self.descriptors.keys),
            ctypes.byref(self.descriptors.values), self.tables.data_ptr(), self.tables.shape[1],
            self.num_code_blocks.data_ptr(),
        )  # fmt: skip
