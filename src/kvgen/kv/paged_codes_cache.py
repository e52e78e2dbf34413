"""QuantizedPagedCache: one sequence's block table over a QuantizedPagedStorage (kv/paged_codes.py).

The block-table bookkeeping (reserve, adopt, fork, copy-on-write, truncate) is PagedCache's; what
changes is where positions live: full blocks before the one being written hold codes, and the block
being written is staged in fp32. So `prepare_write` also stages the blocks a forward writes into
(taking a staging slot, or decoding a block's codes into one after a truncation), `commit` encodes
each staged block that became full, and every reader sees codes for full blocks and fp32 for the
rest, as a QuantizedCache with no residual window does.
"""

from __future__ import annotations

import torch

from kvgen.kv.block_pool import Block
from kvgen.kv.interface import KVCache, KVLayout, Rerotate
from kvgen.kv.paged import CacheFullError, PagedCache
from kvgen.kv.paged_codes import QuantizedPagedStorage
from kvgen.kv.paged_codes_batch import QuantizedPagedBatchView


class QuantizedPagedCache(PagedCache):
    storage: QuantizedPagedStorage
    batch_path_only = True  # its kernels read block tables (kv/paged_codes_batch.py), even for one row

    def __init__(self, storage: QuantizedPagedStorage):
        super().__init__(storage)  # type: ignore[arg-type]

    def prepare_write(self, start: int, end: int) -> bool:
        """As PagedCache.prepare_write, and every block the write leaves partly filled, or starts
        inside, is staged (fp32 slot). False, with nothing changed, when blocks or slots run out."""
        storage, pool, size = self.storage, self.storage.pool, self.storage.block_size
        missing = max(0, pool.blocks_for(end) - len(self.blocks))
        if end <= start:
            fresh = pool.allocate(missing) if missing else []
            if fresh is None:
                return False
            self.blocks.extend(fresh)
            self._refresh_table()
            return True
        first, last = start // size, (end - 1) // size
        staged = {first} if start % size else set()
        if end % size:
            staged.add(last)
        shared = [i for i in range(first, min(len(self.blocks), last + 1)) if self.blocks[i].ref_count > 1]
        slots = sum(1 for i in staged if i >= len(self.blocks) or i in shared or not storage.is_staged(self.blocks[i]))
        slots += sum(1 for i in shared if i not in staged and storage.is_staged(self.blocks[i]))
        if slots > storage.num_free_slots:
            return False
        fresh = pool.allocate(missing + len(shared)) if missing or shared else []
        if fresh is None:
            return False
        for index, copy in zip(shared, fresh):
            storage.copy_block(self.blocks[index].block_id, copy.block_id)  # its slot too, if staged
            pool.free([self.blocks[index]])  # still referenced by the other sequence
            self.blocks[index] = copy
        self.blocks.extend(fresh[len(shared) :])
        for index in sorted(staged):
            block = self.blocks[index]
            if storage.is_staged(block):
                continue
            if index == first and start % size:  # committed positions in codes: back to fp32
                storage.stage_from_codes(block, index * size)
            else:
                storage.take_slot(block)
        self._refresh_table()
        return True

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert keys.shape[0] == 1, "a QuantizedPagedCache holds one sequence"
        start = self._seq_len
        self._prepare_write(start, start + keys.shape[2])
        self.storage.write(layer, self.blocks, start, keys[0], values[0])
        old_keys, old_values = self.history(layer, start)  # [H, start, D]
        return torch.cat((old_keys, keys[0]), 1)[None], torch.cat((old_values, values[0]), 1)[None]

    def history(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions 0..length-1 of `layer` as attention reads them: keys, values [H, length, D]."""
        size, storage = self.storage.block_size, self.storage
        num_blocks = -(-length // size)
        coded = 0
        while coded < num_blocks and not storage.is_staged(self.blocks[coded]):
            coded += 1
        parts = [storage.read_codes(layer, [b.block_id for b in self.blocks[:coded]])]
        for index in range(coded, num_blocks):  # the staged block (and any codes after it)
            block = self.blocks[index]
            count = min(size, length - index * size)
            if storage.is_staged(block):
                parts.append(storage.staged_prefix(layer, block, count))
            else:
                keys, values = storage.read_codes(layer, [block.block_id])
                parts.append((keys[:, :count], values[:, :count]))
        keys = torch.cat([k for k, _ in parts], 1)
        values = torch.cat([v for _, v in parts], 1)
        return keys[:, :length], values[:, :length]

    def num_code_blocks(self, start: int) -> int:
        """Blocks before the one holding `start` (all full, all codes, when a forward starts there)."""
        return start // self.storage.block_size

    @classmethod
    def batch_view(cls, caches: list[KVCache], lengths: list[int]) -> object | None:
        return QuantizedPagedBatchView(caches, lengths) if QuantizedPagedBatchView.applies(caches, cls) else None

    def kernel_layout(self, num_tokens: int) -> KVLayout | None:
        return None

    def commit(self, num_tokens: int) -> None:
        size = self.storage.block_size
        for index in range(self._seq_len // size, (self._seq_len + num_tokens) // size):
            block = self.blocks[index]
            if self.storage.is_staged(block):
                self.storage.encode_staged(block, index * size)
        super().commit(num_tokens)

    def truncate(self, num_tokens: int) -> None:
        dropped = self.blocks[self.storage.pool.blocks_for(max(0, num_tokens)) :]
        super().truncate(num_tokens)
        self.storage.released(dropped)

    def remove_range(self, start: int, end: int, rerotate: Rerotate) -> None:
        """Drop positions start..end-1: the later positions are read back (codes decoded), moved,
        keys turned by `rerotate`, and written again from `start` (re-encoded: one more rounding for
        the moved positions, as QuantizedCache's remove_range re-encodes moved keys)."""
        if not 0 <= start <= end <= self._seq_len:
            raise ValueError(f"cannot remove positions {start}..{end}: the cache holds {self._seq_len}")
        removed, old_removed = end - start, self._removed
        if removed == 0:
            return
        moved = []
        for layer in range(self.spec.num_layers):
            keys, values = self.history(layer, self._seq_len)  # [H, L, D]
            moved.append((rerotate(layer, keys[None, :, end:], -removed)[0], values[:, end:]))
        new_len = self._seq_len - removed
        self.truncate(start)
        if not self.prepare_write(start, new_len):
            raise CacheFullError("the KV block pool is full: no block or staging slot left to move positions into")
        for layer, (keys, values) in enumerate(moved):
            self.storage.write(layer, self.blocks, start, keys, values)
        self.commit(new_len - start)
        self._removed = old_removed + removed

    def copy_prefix(self, source: KVCache, num_tokens: int) -> None:
        self._check_copy_source(source, num_tokens)
        assert isinstance(source, QuantizedPagedCache)
        whole, partial = divmod(num_tokens, self.storage.block_size)
        if partial and self.storage.num_free_slots == 0:  # the copied partial block is staged: checked first
            raise CacheFullError("no staging slot left for the partial last block of the prefix")
        old = list(self.blocks)
        super().copy_prefix(source, num_tokens)
        self.storage.released(old)
        if partial and not self.storage.is_staged(self.blocks[whole]):  # copied from codes: back to fp32
            self.storage.stage_from_codes(self.blocks[whole], whole * self.storage.block_size)

    def memory_bytes(self) -> int:
        slot = QuantizedPagedStorage.slot_bytes(self.spec, self.storage.block_size)
        return sum(self.storage.bytes_per_block() + (slot if self.storage.is_staged(b) else 0) for b in self.blocks)

    def staged_blocks(self) -> list[Block]:
        return [b for b in self.blocks if self.storage.is_staged(b)]

    def check_invariants(self) -> None:
        super().check_invariants()
        size = self.storage.block_size
        for index in range(self._seq_len // size):
            assert not self.storage.is_staged(self.blocks[index]), f"full block {index} is still staged"
