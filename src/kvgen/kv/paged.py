"""Paged KV cache: sequences hold block tables into one shared, preallocated block store.

PagedStorage owns the tensors and the BlockPool that accounts for them; a PagedCache is one
sequence's view (its block table and length). Forks share blocks; the first write into a shared
block copies it (copy-on-write). Truncation returns whole blocks to the pool.
"""

from __future__ import annotations

import torch

from kvgen.errors import KvgenError
from kvgen.kv.block_pool import Block, BlockPool
from kvgen.kv.interface import CacheSpec, KVCache, KVLayout


class CacheFullError(KvgenError):
    """The block pool has no free block for a sequence that needs one."""


class PagedStorage:
    def __init__(self, spec: CacheSpec, pool: BlockPool):
        self.spec, self.pool = spec, pool
        shape = (spec.num_layers, pool.num_blocks, spec.num_kv_heads, pool.block_size, spec.head_dim)
        self.keys = torch.zeros(shape, dtype=spec.dtype)  # [L, N, H, bs, D]
        self.values = torch.zeros(shape, dtype=spec.dtype)

    @classmethod
    def create(cls, spec: CacheSpec, budget_mb: float, block_size: int = 16) -> "PagedStorage":
        return cls(spec, BlockPool.from_budget(budget_mb, spec.bytes_per_token, block_size))

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def copy_block(self, source: int, target: int) -> None:
        self.keys[:, target] = self.keys[:, source]
        self.values[:, target] = self.values[:, source]

    def bytes_per_block(self) -> int:
        return self.spec.bytes_per_token * self.block_size


class PagedCache(KVCache):
    def __init__(self, storage: PagedStorage):
        self.storage = storage
        self.spec = storage.spec
        self.blocks: list[Block] = []
        self._seq_len = 0
        self._table = torch.zeros(0, dtype=torch.int64)  # block ids, kept in step with self.blocks

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.storage.block_size

    def reserve(self, num_tokens: int) -> bool:
        """Hold blocks for `num_tokens` positions; False (nothing taken) if the pool is short."""
        missing = self.storage.pool.blocks_for(num_tokens) - len(self.blocks)
        if missing <= 0:
            return True
        fresh = self.storage.pool.allocate(missing)
        if fresh is None:
            return False
        self.blocks.extend(fresh)
        self._refresh_table()
        return True

    def adopt(self, blocks: list[Block], num_tokens: int) -> None:
        """Start an empty cache from shared full blocks that hold positions 0..num_tokens-1 (a
        prefix-cache hit): takes a reference on each; later writes go to fresh blocks after them."""
        assert not self.blocks and self._seq_len == 0, "adopt() needs an empty cache"
        assert num_tokens == len(blocks) * self.storage.block_size, "adopt() takes whole blocks only"
        self.storage.pool.share(blocks)
        self.blocks, self._seq_len = list(blocks), num_tokens
        self._refresh_table()

    def _prepare_write(self, start: int, end: int) -> None:
        if not self.reserve(end):
            raise CacheFullError(
                f"the KV block pool is full ({self.storage.pool.num_blocks} blocks of {self.storage.block_size} "
                "tokens): raise the KV budget, lower max_new_tokens, or free other sequences"
            )
        size = self.storage.block_size
        for index in range(start // size, -(-end // size)):
            block = self.blocks[index]
            if block.ref_count > 1:  # shared with a fork: copy before writing
                replacement = self.storage.pool.allocate(1)
                if replacement is None:
                    raise CacheFullError("the KV block pool is full: no block left to copy a shared block into")
                self.storage.copy_block(block.block_id, replacement[0].block_id)
                self.storage.pool.free([block])
                self.blocks[index] = replacement[0]
                self._refresh_table()

    def _refresh_table(self) -> None:
        self._table = torch.tensor([b.block_id for b in self.blocks], dtype=torch.int64)

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert keys.shape[0] == 1, "a PagedCache holds one sequence"
        start, end = self._seq_len, self._seq_len + keys.shape[2]
        self._prepare_write(start, end)
        size, store_k, store_v = self.storage.block_size, self.storage.keys[layer], self.storage.values[layer]
        position = start
        while position < end:  # one slice copy per block spanned
            block, offset = self.blocks[position // size].block_id, position % size
            count = min(size - offset, end - position)
            source = slice(position - start, position - start + count)
            store_k[block, :, offset : offset + count] = keys[0, :, source]
            store_v[block, :, offset : offset + count] = values[0, :, source]
            position += count
        return self._gather(store_k, end), self._gather(store_v, end)

    def _gather(self, store: torch.Tensor, length: int) -> torch.Tensor:
        """[N, H, bs, D] -> this sequence's first `length` positions, [1, H, length, D] (a copy: the
        torch attention path needs one tensor; kernels read blocks in place via kernel_layout)."""
        used = self._table[: -(-length // self.storage.block_size)]
        gathered = store.index_select(0, used)  # [n, H, bs, D]
        heads, dim = gathered.shape[1], gathered.shape[3]
        return gathered.transpose(0, 1).reshape(heads, -1, dim)[None, :, :length]

    def kernel_layout(self, num_tokens: int) -> KVLayout | None:
        if self.spec.dtype != torch.float32:
            return None
        self._prepare_write(self._seq_len, num_tokens)
        k = self.storage.keys  # [L, N, H, bs, D]
        return KVLayout(k, self.storage.values, k.stride(0), k.stride(2), k.stride(3), k.stride(1),
                        self.storage.block_size, self._table)  # fmt: skip

    def commit(self, num_tokens: int) -> None:
        assert self._seq_len + num_tokens <= self.capacity, "commit past the reserved blocks"
        self._seq_len += num_tokens

    def truncate(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._seq_len:
            raise ValueError(f"cannot truncate to {num_tokens}: the cache holds {self._seq_len} positions")
        keep = self.storage.pool.blocks_for(num_tokens)  # truncate(0) = release: every block back to the pool
        self.storage.pool.free(self.blocks[keep:])
        del self.blocks[keep:]
        self._seq_len = num_tokens
        self._refresh_table()

    def fork(self) -> "PagedCache":
        twin = PagedCache(self.storage)
        self.storage.pool.share(self.blocks)
        twin.blocks, twin._seq_len = list(self.blocks), self._seq_len
        twin._refresh_table()
        return twin

    def memory_bytes(self) -> int:
        return len(self.blocks) * self.storage.bytes_per_block()

    def check_invariants(self) -> None:
        super().check_invariants()
        assert len(self.blocks) >= self.storage.pool.blocks_for(self._seq_len), "blocks do not cover seq_len"
        assert all(b.ref_count > 0 for b in self.blocks), "a table entry points at a free block"
        assert self._table.tolist() == [b.block_id for b in self.blocks], "block table out of date"
