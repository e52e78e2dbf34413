"""One batched read and write of the paged block store for a ragged batch of sequences.

`BatchCacheView` (models/batch.py) works for any mix of caches: per layer and per row it writes the
row's new keys, gathers the row's history into a fresh tensor, then copies every row into a padded
batch — about four tensor operations per row per layer, which dominates a batched decode step of a
small model. When every row is a `PagedCache` of one `PagedStorage` (the engine's case) the slots
are known before the first layer: `PagedBatchView` computes them once per forward, and each layer
then does one scatter for the new keys, one for the values, and one gather of every row's blocks.
A batch of one-token rows (decodes) over an fp32 store skips the gather too: `attend_in_place`
runs the C kernel that reads each row's blocks where they are.
"""

from __future__ import annotations

import torch

from kvgen.kernels import load
from kvgen.kv.interface import AttentionSpan, KVCache


class PagedBatchView:
    """Duck-types the one method Attention uses (`update`) for rows that share one PagedStorage."""

    @staticmethod
    def applies(caches: list[KVCache], cache_type: type) -> bool:
        """Every row a `cache_type` (kv/paged.py PagedCache) over one PagedStorage."""
        return all(type(c) is cache_type for c in caches) and len({id(c.storage) for c in caches}) == 1  # type: ignore[attr-defined]

    def __init__(self, caches: list, lengths: list[int]):  # caches: PagedCache rows (kv/paged.py)
        storage = caches[0].storage
        size = storage.block_size
        self.storage = storage
        self.keys_store, self.values_store = storage.keys, storage.values  # [slots, N, H, bs, D]
        self.group_of = storage.groups.group_of  # per layer: whose block table it reads
        starts = [c.seq_len for c in caches]
        ends = [s + n for s, n in zip(starts, lengths)]
        for cache, start, end in zip(caches, starts, ends):
            cache._prepare_write(start, end)  # blocks (and copy-on-write) once per forward, not per layer
        tables = [cache.group_tables(end) for cache, end in zip(caches, ends)]  # [row][group] -> block ids [n]
        self.rows = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
        self.columns = torch.cat([torch.arange(n) for n in lengths])
        positions = [torch.arange(start, start + n) for start, n in zip(starts, lengths)]
        self.slot_offsets = torch.cat(positions) % size
        self.num_keys = max(ends)
        self.blocks_per_row = -(-self.num_keys // size)
        self.slot_blocks, self.tables = [], []
        for group in range(storage.groups.num_groups):
            self.slot_blocks.append(torch.cat([t[group][p // size] for t, p in zip(tables, positions)]))
            # Each row's block table padded to the longest with its first block: the padding is read
            # but masked out (the store holds only finite values, so masked keys contribute exactly zero).
            rows_tables = [t[group] for t in tables]
            self.tables.append(torch.cat([torch.cat([t, t[:1].expand(self.blocks_per_row - len(t))]) for t in rows_tables]))
        self.table = self.tables[0]
        self.num_rows = len(caches)
        self.lengths = lengths
        self.ends = torch.tensor(ends)

    def in_place_starts(self, lengths: list[int], spans: tuple[AttentionSpan, ...]) -> torch.Tensor | None:
        """Per row, the first position its one query sees, when this layer's attention can run in
        place (`attend_in_place`): every row one token, an fp32 store, the kernels built, and each
        row's visible keys one range (no sinks; a paged cache keeps every position from 0). None
        otherwise (the caller gathers and runs SDPA)."""
        if any(n != 1 for n in lengths) or self.keys_store.dtype != torch.float32 or load() is None:
            return None
        if any(span.sinks for span in spans):
            return None
        return torch.tensor([span.decode_start(end - 1, 0) for span, end in zip(spans, self.ends.tolist())])

    def attend_in_place(self, layer: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                        starts: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Write the rows' new keys/values, then attention of q [B, H, 1, D] over each row's
        positions starts[r]..its own, read from the blocks in place -> [B, H, 1, D]."""
        k_store, v_store = self.storage.layer_stores(layer)  # [N, H_kv, bs, D]
        group = self.group_of[layer]
        self._write(k_store, keys, group)
        if not self.storage.spec.values_are_keys:
            self._write(v_store, values, group)
        rows, heads, _, dim = q.shape
        q = q.contiguous()
        out = torch.empty_like(q)
        load().kvgen_paged_decode_attention(
            q.data_ptr(), out.data_ptr(), k_store.data_ptr(), v_store.data_ptr(), rows, heads, k_store.shape[1], dim,
            scale, k_store.stride(1), k_store.stride(2), k_store.stride(0), k_store.shape[2],
            self.tables[group].data_ptr(), self.blocks_per_row, starts.data_ptr(), self.ends.data_ptr(),
        )  # fmt: skip
        return out

    def rows_kernel(self) -> tuple[str, tuple] | None:
        """For rows over fp32 blocks, the C step over every layer (kernels/decode.c
        kvgen_decode_rows) and the store's arguments; None for other stores. The step runs one
        token per kernel row: a sequence with several new tokens (a speculative verify) is several
        kernel rows on its block table at consecutive positions, and since each layer stores every
        row's key and value before any row attends, each sees the ones before it. A pool of layer
        groups passes each layer's slot and group, and every group's tables one after another."""
        keys, values = self.keys_store, self.values_store  # [slots, N, H_kv, bs, D]
        if keys.dtype != torch.float32:
            return None
        assert keys.stride() == values.stride()
        groups = self.storage.groups
        tables = self.tables
        if any(n != 1 for n in self.lengths):  # one table per kernel row
            repeats = torch.tensor(self.lengths)
            tables = [t.view(self.num_rows, -1).repeat_interleave(repeats, dim=0).reshape(-1) for t in tables]
        if groups.is_single:
            self._row_tables = tables[0]  # kept on the view: the C side reads it during the step
            tables, slots, group_of = self._row_tables, None, None
        else:
            self._stacked = torch.stack(tables).contiguous()  # [groups, rows * blocks_per_row]
            tables, (slots, group_of) = self._stacked, self.storage.layer_slots_and_groups
        return "kvgen_decode_rows", (
            keys.data_ptr(), values.data_ptr(), keys.stride(0), keys.stride(2), keys.stride(3), keys.stride(1),
            keys.shape[3], tables.data_ptr(), self.blocks_per_row,
            slots.data_ptr() if slots is not None else None, group_of.data_ptr() if group_of is not None else None,
        )  # fmt: skip

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """keys/values [B, H_kv, S_max, D] -> every row's keys/values so far, [B, H_kv, L_max, D]."""
        k_store, v_store = self.storage.layer_stores(layer)
        group = self.group_of[layer]
        keys_so_far = self._write_then_read(k_store, keys, group)
        if self.storage.spec.values_are_keys:  # one store (latent attention): the keys are the values
            return keys_so_far, keys_so_far
        return keys_so_far, self._write_then_read(v_store, values, group)

    def _write(self, store: torch.Tensor, new: torch.Tensor, group: int) -> None:
        # store [N, H, bs, D]; the real (unpadded) new tokens, [T, H, D], go to their slots.
        store[self.slot_blocks[group], :, self.slot_offsets] = new.transpose(1, 2)[self.rows, self.columns].to(store.dtype)

    def _write_then_read(self, store: torch.Tensor, new: torch.Tensor, group: int) -> torch.Tensor:
        self._write(store, new, group)
        heads, size, dim = store.shape[1], store.shape[2], store.shape[3]
        gathered = store.index_select(0, self.tables[group]).view(self.num_rows, self.blocks_per_row, heads, size, dim)
        history = gathered.transpose(1, 2).reshape(self.num_rows, heads, self.blocks_per_row * size, dim)
        return history[:, :, : self.num_keys]
