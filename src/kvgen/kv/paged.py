"""Paged KV cache: sequences hold block tables into one shared, preallocated block store.

PagedStorage owns the tensors and the BlockPool that accounts for them; a PagedCache is one
sequence's view (its block table and length). Forks share blocks; the first write into a shared
block copies it (copy-on-write). Truncation returns whole blocks to the pool.
"""

from __future__ import annotations

import torch

from kvgen.errors import KvgenError
from kvgen.kv import huge_pages
from kvgen.kv.block_pool import Block, BlockPool
from kvgen.kv.interface import CacheSpec, KVCache, KVLayout, Rerotate
from kvgen.kv.layer_groups import LayerGroups
from kvgen.kv.paged_batch import PagedBatchView


_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


class CacheFullError(KvgenError):
    """The block pool has no free block for a sequence that needs one."""


class PagedStorage:
    def __init__(self, spec: CacheSpec, pool: BlockPool, groups: LayerGroups | None = None):
        """`groups`: how pages are shared among layer groups (kv/layer_groups.py); default one
        group of every layer, so a block holds every layer and the store is [L, N, H, bs, D]."""
        self.spec, self.pool = spec, pool
        self.groups = groups or LayerGroups.single(spec.num_layers)
        if len(self.groups.group_of) != spec.num_layers:
            raise ValueError(f"layer groups cover {len(self.groups.group_of)} layers, the cache has {spec.num_layers}")
        shape = (self.groups.width, pool.num_blocks, spec.num_kv_heads, pool.block_size, spec.head_dim)
        # [slots, N, H, bs, D]; slots = L for one group. On huge pages (kv/huge_pages.py): a block's
        # kv head is 4 KB at 16 positions, a page of its own on 4 KB pages (one request at 4,000
        # positions decoded 1.05x as fast on huge pages).
        self.keys = huge_pages.zeros(shape, spec.dtype)
        # Where values are keys (latent attention) one store serves both; writes of values are skipped.
        self.values = self.keys if spec.values_are_keys else huge_pages.zeros(shape, spec.dtype)
        # Per layer its slot and group, as int64 for the C decode step (made once, read every step).
        self.layer_slots_and_groups = (torch.tensor(self.groups.slot_of), torch.tensor(self.groups.group_of))

    @classmethod
    def create(cls, spec: CacheSpec, budget_mb: float, block_size: int = 16,
               groups: LayerGroups | None = None) -> "PagedStorage":  # fmt: skip
        groups = groups or LayerGroups.single(spec.num_layers)
        bytes_per_token = spec.bytes_per_token * groups.width // spec.num_layers  # one page's layers
        return cls(spec, BlockPool.from_budget(budget_mb, bytes_per_token, block_size), groups)

    def layer_stores(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Where `layer` keeps its keys and values: [N, H, bs, D] each, indexed by its group's block ids."""
        slot = self.groups.slot_of[layer]
        return self.keys[slot], self.values[slot]

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def copy_block(self, source: int, target: int) -> None:
        self.keys[:, target] = self.keys[:, source]
        if not self.spec.values_are_keys:
            self.values[:, target] = self.values[:, source]

    def bytes_per_block(self) -> int:
        """Bytes of one pool block (one page: `groups.width` layers' keys and values)."""
        return self.spec.bytes_per_token * self.groups.width // self.spec.num_layers * self.block_size

    # --- block export / import: what a lower tier (kv/disk_tier.py) stores, format-agnostic ----
    @property
    def format_key(self) -> str:
        """Names the stored format and block size ("fp32/fp32/bs16": keys/values/block size, the
        values "keys" where they are the keys); a block exported by one storage imports only into a
        storage with the same format_key."""
        name = _DTYPE_NAMES.get(self.spec.dtype, str(self.spec.dtype).removeprefix("torch."))
        grouped = "" if self.groups.is_single else f"/{self.groups.describe()}"
        values = "keys" if self.spec.values_are_keys else name
        return f"{name}/{values}/bs{self.block_size}{grouped}"

    def _stores(self) -> dict[str, torch.Tensor]:
        """The stores a block lives in, by name: keys and values, or the keys alone."""
        if self.spec.values_are_keys:
            return {"keys": self.keys}
        return {"keys": self.keys, "values": self.values}

    def export_block(self, block_id: int) -> dict[str, torch.Tensor]:
        """Copies of every layer's stored tensors of one block: keys and values (or the keys
        alone, where they are the values), [L, H, bs, D] each."""
        return {name: store[:, block_id].clone() for name, store in self._stores().items()}

    def import_block(self, block_id: int, parts: dict[str, torch.Tensor]) -> None:
        """The inverse of export_block: ValueError (nothing written) unless `parts` has exactly the
        tensors export_block gives, with their shapes and dtypes."""
        stores = self._stores()
        if set(parts) != set(stores):
            raise ValueError(f"a {self.format_key} block holds tensors {sorted(stores)}, got {sorted(parts)}")
        for name, store in stores.items():
            want, got = store[:, block_id], parts[name]
            if got.shape != want.shape or got.dtype != want.dtype:
                raise ValueError(f"block tensor {name!r} must be {tuple(want.shape)} {want.dtype}, got {tuple(got.shape)} {got.dtype}")
        for name, store in stores.items():
            store[:, block_id] = parts[name]

    def released(self, blocks: list[Block]) -> None:
        """Blocks a sequence gave up (nothing to do here: the pool has them back)."""


class PagedCache(KVCache):
    def __init__(self, storage: PagedStorage):
        self.storage = storage
        self.spec = storage.spec
        self.blocks: list[Block] = []
        self._seq_len = 0
        self._removed = 0  # positions dropped by remove_range since the cache was last empty
        self._table = torch.zeros(0, dtype=torch.int64)  # block ids, kept in step with self.blocks

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.storage.block_size

    def reserve(self, num_tokens: int) -> bool:
        """Hold writable blocks for `num_tokens` positions in all; False (nothing taken) if the pool is short."""
        return self.prepare_write(min(self._seq_len, num_tokens), num_tokens)

    def prepare_write(self, start: int, end: int) -> bool:
        """Make positions start..end-1 writable: blocks up to `end`, and a private copy of every
        shared block in the range (copy-on-write done now, so the write itself cannot fail).
        False, with nothing changed, when the pool has too few free blocks."""
        size = self.storage.block_size
        missing = max(0, self.storage.pool.blocks_for(end) - len(self.blocks))
        written = range(start // size, min(len(self.blocks), -(-end // size))) if end > start else range(0)
        shared = [i for i in written if self.blocks[i].ref_count > 1]
        fresh = self.storage.pool.allocate(missing + len(shared)) if missing or shared else []
        if fresh is None:
            return False
        for index, copy in zip(shared, fresh):
            self.storage.copy_block(self.blocks[index].block_id, copy.block_id)
            self.storage.pool.free([self.blocks[index]])  # still referenced by the other sequence
            self.blocks[index] = copy
        self.blocks.extend(fresh[len(shared) :])
        self._refresh_table()
        return True

    def adopt(self, blocks: list[Block], num_tokens: int, pages: list[tuple[Block | None, ...]] | None = None) -> None:
        """Start an empty cache from shared full blocks that hold positions 0..num_tokens-1 (a
        prefix-cache hit): takes a reference on each; later writes go to fresh blocks after them.
        `pages`: other layer groups' pages of those blocks (kv/paged_hybrid.py); none here."""
        assert not pages or not any(pages), "a cache of one layer group adopts no window pages"
        assert not self.blocks and self._seq_len == 0, "adopt() needs an empty cache"
        assert num_tokens == len(blocks) * self.storage.block_size, "adopt() takes whole blocks only"
        self.storage.pool.share(blocks)
        self.blocks, self._seq_len = list(blocks), num_tokens
        self._refresh_table()

    def _prepare_write(self, start: int, end: int) -> None:
        if not self.prepare_write(start, end):
            raise CacheFullError(
                f"the KV block pool is full ({self.storage.pool.num_blocks} blocks of {self.storage.block_size} "
                "tokens): raise the KV budget, lower max_new_tokens, or free other sequences"
            )

    def _refresh_table(self) -> None:
        self._table = torch.tensor([b.block_id for b in self.blocks], dtype=torch.int64)

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert keys.shape[0] == 1, "a PagedCache holds one sequence"
        start, end = self._seq_len, self._seq_len + keys.shape[2]
        self._prepare_write(start, end)
        self._write(layer, start, keys, values)
        store_k, store_v = self.storage.layer_stores(layer)
        keys_so_far = self._gather(layer, store_k, end)
        return keys_so_far, keys_so_far if self.spec.values_are_keys else self._gather(layer, store_v, end)

    def _layer_table(self, layer: int) -> torch.Tensor:
        """The block ids `layer` reads and writes (its layer group's table)."""
        return self._table

    def _write(self, layer: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store [1, H, S, D] at positions start.. of `layer` (blocks already prepared)."""
        size, (store_k, store_v) = self.storage.block_size, self.storage.layer_stores(layer)
        table = self._layer_table(layer)
        position, end = start, start + keys.shape[2]
        while position < end:  # one slice copy per block spanned
            block, offset = int(table[position // size]), position % size
            count = min(size - offset, end - position)
            source = slice(position - start, position - start + count)
            store_k[block, :, offset : offset + count] = keys[0, :, source]
            if not self.spec.values_are_keys:
                store_v[block, :, offset : offset + count] = values[0, :, source]
            position += count

    def _gather(self, layer: int, store: torch.Tensor, length: int) -> torch.Tensor:
        """[N, H, bs, D] -> this sequence's first `length` positions, [1, H, length, D] (a copy: the
        torch attention path needs one tensor; kernels read blocks in place via kernel_layout)."""
        used = self._layer_table(layer)[: -(-length // self.storage.block_size)]
        gathered = store.index_select(0, used)  # [n, H, bs, D]
        heads, dim = gathered.shape[1], gathered.shape[3]
        return gathered.transpose(0, 1).reshape(heads, -1, dim)[None, :, :length]

    # --- what the engine's batch view, scheduler and prefix index ask of any paged sequence -------
    def group_tables(self, num_tokens: int) -> list[torch.Tensor]:
        """Per layer group (kv/layer_groups.py), the block ids holding positions 0..num_tokens-1 (int64)."""
        return [self._table[: self.storage.pool.blocks_for(num_tokens)]]

    def held_blocks(self) -> list[Block]:
        """Every pool block this sequence holds a reference on."""
        return list(self.blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        """Fresh blocks reserve(num_tokens) takes beyond those held (before copy-on-write)."""
        return max(0, self.storage.pool.blocks_for(num_tokens) - len(self.blocks))

    def window_pages(self) -> list[tuple[Block | None, ...]]:
        """Per anchor block, the other layer groups' pages of the same positions (none here: one group)."""
        return [() for _ in self.blocks]

    @classmethod
    def batch_view(cls, caches: list[KVCache], lengths: list[int]) -> object | None:
                return PagedBatchView(caches, lengths) if PagedBatchView.applies(caches, cls) else None

    def kernel_layout(self, num_tokens: int) -> KVLayout | None:
        if self.spec.dtype != torch.float32 or not self.storage.groups.is_single:
            return None  # the one-table C step reads every layer through one block table
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
        self._removed = self._removed if num_tokens else 0
        self._refresh_table()

    @property
    def positions_removed(self) -> int:
        return self._removed

    def remove_range(self, start: int, end: int, rerotate: Rerotate) -> None:
        """As ContiguousCache.remove_range: the tail moves back into the removed positions (shared
        blocks there are copied first), then the blocks past the new end go back to the pool."""
        if not 0 <= start <= end <= self._seq_len:
            raise ValueError(f"cannot remove positions {start}..{end}: the cache holds {self._seq_len}")
        removed, new_len = end - start, self._seq_len - (end - start)
        if removed == 0:
            return
        if not self.prepare_write(start, new_len):
            raise CacheFullError("the KV block pool is full: no block left to copy a shared block into before moving positions")
        for layer in range(self.spec.num_layers):
            store_k, store_v = self.storage.layer_stores(layer)
            keys = self._gather(layer, store_k, self._seq_len)[:, :, end:]  # [1, H, tail, D] copies
            values = self._gather(layer, store_v, self._seq_len)[:, :, end:]
            self._write(layer, start, rerotate(layer, keys, -removed), values)
        self.truncate(new_len)
        self._removed += removed

    def copy_prefix(self, source: KVCache, num_tokens: int) -> None:
        """Share `source`'s whole blocks of the prefix by reference count; copy its partial last block
        (so neither sequence's next write has to). Full pool: CacheFullError, nothing changed."""
        self._check_copy_source(source, num_tokens)
        assert isinstance(source, PagedCache)
        if source.storage is not self.storage:
            raise ValueError("copy_prefix between paged caches needs one shared PagedStorage")
        size = self.storage.block_size
        whole, partial = divmod(num_tokens, size)
        copy = self.storage.pool.allocate(1 if partial else 0)
        if copy is None:
            raise CacheFullError("the KV block pool is full: no block left for the partial last block of the prefix")
        shared = source.blocks[:whole]
        self.storage.pool.share(shared)
        if partial:
            self.storage.copy_block(source.blocks[whole].block_id, copy[0].block_id)
        self.storage.pool.free(self.blocks)
        self.blocks, self._seq_len = [*shared, *copy], num_tokens
        self._removed = source._removed if num_tokens == source.seq_len else 0
        self._refresh_table()

    def fork(self) -> "PagedCache":
        twin = type(self)(self.storage)
        self.storage.pool.share(self.blocks)
        twin.blocks, twin._seq_len, twin._removed = list(self.blocks), self._seq_len, self._removed
        twin._refresh_table()
        return twin

    def memory_bytes(self) -> int:
        return len(self.blocks) * self.storage.bytes_per_block()

    def check_invariants(self) -> None:
        super().check_invariants()
        assert len(self.blocks) >= self.storage.pool.blocks_for(self._seq_len), "blocks do not cover seq_len"
        assert all(b.ref_count > 0 for b in self.blocks), "a table entry points at a free block"
        assert self._table.tolist() == [b.block_id for b in self.blocks], "block table out of date"
