"""TieredCache: blocks of positions in hot RAM (fp32), warm RAM (packed by a codec) or cold files.

Positions are grouped in blocks of `block_size` (all layers). A block is sealed (immutable) once
full; the partial tail is always hot. After every forward pass (`commit`) blocks are placed by
recency of access, LRU: the most recently used `hot_tokens // block_size` blocks are hot, the next
`warm_tokens // block_size` warm, the rest cold. Moving down packs (warm) or writes a file (cold,
once: a sealed block never changes, so its file is kept and reused); moving up reads it back
(promotion, e.g. after a rewind frees budget). With full attention every block is read every pass,
oldest first, so the newest blocks end up hot.

`update(layer)` assembles that layer's keys and values in one scratch buffer shared by all layers
(valid until the next `update`): hot blocks are copied, warm ones unpacked, cold ones read from
disk and verified. Cold reads are prefetched by a thread pool one layer ahead (layer l+1 while
layer l attends; layer 0 of the next pass at commit), so disk time overlaps compute.

A missing or corrupted cold file raises ColdBlockError (kv/tier_store.py) out of the forward pass,
which then leaves the cache as it was. `release()` / `close()` / `with TieredCache(...)` delete every
file and the directory the cache created (a finalizer does too if it is garbage collected).
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvgen.kv.interface import CacheSpec, KVCache, Rerotate
from kvgen.kv.tier_store import WARM_DTYPES, Packed, pack, packed_bytes, read_layer, unpack_layer, write_block

TIERS = ("hot", "warm", "cold")


@dataclass
class _Block:
    """One sealed block; exactly the representation of its tier is held (plus its file once written)."""

    tier: str = "hot"
    hot: tuple[torch.Tensor, torch.Tensor] | None = None  # K, V [L, H, bs, D] fp32
    warm: Packed | None = None
    path: Path | None = None  # cold file; kept while the block lives, since the block never changes
    reads: int = field(default=0)


class TieredCache(KVCache):
    def __init__(
        self, spec: CacheSpec, block_size: int = 16, hot_tokens: int = 256, warm_tokens: int = 1024,
        warm_dtype: str = "fp16", directory: str | Path | None = None, prefetch_workers: int = 2,
    ):  # fmt: skip
        if block_size <= 0 or hot_tokens < 0 or warm_tokens < 0:
            raise ValueError(f"block_size must be positive and budgets >= 0, got {block_size}, {hot_tokens}, {warm_tokens}")
        if warm_dtype not in WARM_DTYPES:
            raise ValueError(f"unknown warm tier dtype {warm_dtype!r}; choose one of {', '.join(WARM_DTYPES)}")
        if spec.dtype != torch.float32:
            raise ValueError(f"the tiered cache keeps its hot tier in fp32; got a {spec.dtype} model")
        self.spec, self.block_size, self.warm_dtype = spec, block_size, warm_dtype
        self.hot_blocks, self.warm_blocks = hot_tokens // block_size, warm_tokens // block_size
        self.parent_dir, self.prefetch_workers = directory, prefetch_workers
        self._blocks: list[_Block] = []
        self._lru: OrderedDict[int, None] = OrderedDict()  # block index, least recently used first
        shape = (spec.num_layers, spec.num_kv_heads, block_size, spec.head_dim)
        self._tail_k, self._tail_v = torch.zeros(shape), torch.zeros(shape)  # positions sealed_end.. [L, H, n, D]
        self._scratch_k = self._scratch_v = torch.zeros(1, spec.num_kv_heads, 0, spec.head_dim)
        self._seq_len = 0
        self._removed = 0  # positions dropped by remove_range since the cache was last empty
        self._dir: Path | None = None
        self._finalizer: weakref.finalize | None = None
        self._files_created = 0  # names stay unique when a block index is reused after a rewind
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[tuple[int, int], Future] = {}  # (block, layer) -> K, V being read
        self.stats = {"cold_reads": 0, "prefetch_hits": 0, "files_written": 0, "promotions": 0, "demotions": 0}

    # --- sizes -------------------------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def capacity(self) -> int:
        return self._sealed_end + self._tail_k.shape[2]

    @property
    def _sealed_end(self) -> int:
        return len(self._blocks) * self.block_size

    @property
    def directory(self) -> Path | None:
        """The temporary directory holding cold files (None until the first block goes cold)."""
        return self._dir

    def tiers(self) -> list[str]:
        """Each sealed block's tier, oldest block first."""
        return [block.tier for block in self._blocks]

    def memory_bytes(self) -> int:
        """RAM held: hot blocks, warm packs, the tail and the assembly scratch (cold files excluded)."""
        held = sum(b.hot[0].numel() * 8 for b in self._blocks if b.hot is not None)
        held += sum(packed_bytes(b.warm) for b in self._blocks if b.warm is not None)
        return held + (self._tail_k.numel() + self._scratch_k.numel()) * 8

    def disk_bytes(self) -> int:
        return sum(b.path.stat().st_size for b in self._blocks if b.path is not None and b.path.exists())

    # --- the forward pass --------------------------------------------------------------------
    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start = self._seq_len - self._sealed_end
        end = start + keys.shape[2]
        self._grow_tail(end)
        self._tail_k[layer, :, start:end] = keys[0]
        self._tail_v[layer, :, start:end] = values[0]
        total = self._sealed_end + end
        if self._scratch_k.shape[2] < total:
            shape = (1, self.spec.num_kv_heads, max(total, 2 * self._scratch_k.shape[2]), self.spec.head_dim)
            self._scratch_k, self._scratch_v = torch.empty(shape), torch.empty(shape)
        if layer + 1 < self.spec.num_layers:
            self._prefetch(layer + 1)
        for index, block in enumerate(self._blocks):
            k, v = self._layer_of(index, block, layer)
            where = slice(index * self.block_size, (index + 1) * self.block_size)
            self._scratch_k[0, :, where], self._scratch_v[0, :, where] = k, v
            if layer == 0:
                self._lru.move_to_end(index)
        self._scratch_k[0, :, self._sealed_end : total] = self._tail_k[layer, :, :end]
        self._scratch_v[0, :, self._sealed_end : total] = self._tail_v[layer, :, :end]
        return self._scratch_k[:, :, :total], self._scratch_v[:, :, :total]

    def _layer_of(self, index: int, block: _Block, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if block.tier == "hot":
            return block.hot[0][layer], block.hot[1][layer]
        if block.tier == "warm":
            return unpack_layer({name: t[layer] for name, t in block.warm.items()})
        future = self._pending.pop((index, layer), None)
        self.stats["cold_reads"] += 1
        if future is None:
            return read_layer(block.path, layer)
        self.stats["prefetch_hits"] += future.done()
        return future.result()  # re-raises ColdBlockError from the reader thread

    def _prefetch(self, layer: int) -> None:
        """Start reading `layer` of every cold block that is not already being read."""
        for index, block in enumerate(self._blocks):
            if block.tier == "cold" and (index, layer) not in self._pending:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.prefetch_workers, thread_name_prefix="kvgen-tier")
                self._pending[index, layer] = self._pool.submit(read_layer, block.path, layer)

    def _grow_tail(self, num_positions: int) -> None:
        if num_positions <= self._tail_k.shape[2]:
            return
        size = max(num_positions, 2 * self._tail_k.shape[2])
        for name in ("_tail_k", "_tail_v"):
            old = getattr(self, name)
            grown = torch.zeros((*old.shape[:2], size, old.shape[3]))
            grown[:, :, : old.shape[2]] = old
            setattr(self, name, grown)

    def commit(self, num_tokens: int) -> None:
        self._seq_len += num_tokens
        full = (self._seq_len - self._sealed_end) // self.block_size
        for i in range(full):
            where = slice(i * self.block_size, (i + 1) * self.block_size)
            sealed = (self._tail_k[:, :, where].clone(), self._tail_v[:, :, where].clone())
            self._lru[len(self._blocks)] = None
            self._blocks.append(_Block("hot", sealed))
        if full:
            rest = self._seq_len - self._sealed_end
            moved = slice(full * self.block_size, full * self.block_size + rest)
            self._tail_k[:, :, :rest] = self._tail_k[:, :, moved].clone()
            self._tail_v[:, :, :rest] = self._tail_v[:, :, moved].clone()
            if self._tail_k.shape[2] > 2 * self.block_size:  # a long prefill grew it: back to one block
                self._tail_k = self._tail_k[:, :, : self.block_size].clone()
                self._tail_v = self._tail_v[:, :, : self.block_size].clone()
        self._rebalance()
        self._prefetch(0)  # the next pass starts at layer 0

    # --- placement ---------------------------------------------------------------------------
    def _rebalance(self) -> None:
        """Most recently used blocks hot, the next warm, the rest cold."""
        for rank, index in enumerate(reversed(self._lru)):
            wanted = "hot" if rank < self.hot_blocks else "warm" if rank < self.hot_blocks + self.warm_blocks else "cold"
            self._move(index, wanted)

    def _move(self, index: int, tier: str) -> None:
        block = self._blocks[index]
        if block.tier == tier:
            return
        self.stats["promotions" if TIERS.index(tier) < TIERS.index(block.tier) else "demotions"] += 1
        if tier == "hot":
            block.hot = self._block_fp32(index, block)
        elif tier == "warm":
            block.warm = pack(*block.hot, self.warm_dtype) if block.tier == "hot" else self._read_packed(index, block)
        else:
            if block.path is None:
                block.path = self._new_path(index)
                write_block(block.path, block.warm if block.warm is not None else pack(*block.hot, self.warm_dtype))
                self.stats["files_written"] += 1
        block.tier = tier
        if tier != "hot":
            block.hot = None
        if tier != "warm":
            block.warm = None

    def _block_fp32(self, index: int, block: _Block) -> tuple[torch.Tensor, torch.Tensor]:
        """All layers of a block as fp32 [L, H, bs, D] K and V, from whatever tier holds it."""
        if block.tier == "hot":
            return block.hot
        layers = [self._layer_of(index, block, layer) for layer in range(self.spec.num_layers)]
        return torch.stack([k for k, _ in layers]), torch.stack([v for _, v in layers])

    def _read_packed(self, index: int, block: _Block) -> Packed:
        # Re-packing what was read back from the same codec gives the same values (fp casts and
        # int8 with its per-position scale are idempotent), so a cold -> warm promotion is lossless.
        return pack(*self._block_fp32(index, block), self.warm_dtype)

    def _new_path(self, index: int) -> Path:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="kvgen-tier-", dir=self.parent_dir))
            self._finalizer = weakref.finalize(self, shutil.rmtree, self._dir, True)
        self._files_created += 1
        return self._dir / f"block{index}-{self._files_created}.kv"

    # --- rewinds, forks, cleanup -------------------------------------------------------------
    def _drain(self) -> None:
        """Wait for reads in flight (their errors no longer matter) and forget them."""
        for future in self._pending.values():
            future.cancel() or future.exception()
        self._pending.clear()

    def truncate(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._seq_len:
            raise ValueError(f"cannot truncate to {num_tokens}: the cache holds {self._seq_len} positions")
        self._drain()
        keep = num_tokens // self.block_size
        if keep < len(self._blocks):
            new_tail = self._block_fp32(keep, self._blocks[keep])  # verified before anything is dropped
            for index in range(keep, len(self._blocks)):
                self._forget(index)
            del self._blocks[keep:]
            self._tail_k[:, :, : self.block_size] = new_tail[0]
            self._tail_v[:, :, : self.block_size] = new_tail[1]
        self._seq_len = num_tokens
        self._removed = self._removed if num_tokens else 0
        self._rebalance()

    @property
    def positions_removed(self) -> int:
        return self._removed

    def remove_range(self, start: int, end: int, rerotate: Rerotate) -> None:
        """Drop positions start..end-1; later ones move back by end - start (see KVCache).

        Sealed blocks wholly before `start` stay as they are. Each later block that remains is
        rebuilt from the positions that now fall in it (moved keys turned by `rerotate`) and keeps
        the tier of the block it replaces: hot blocks are exact; warm and cold ones are packed again
        in warm_dtype, which rounds the turned keys once more (fp16: 2^-11 relative, bf16: 2^-8,
        int8: amax/254 per position) while values and unmoved keys pack to the same numbers (the
        casts and int8 are idempotent). Fp32 warm storage is exact. Old blocks are read one at a
        time, and every new block is built (cold ones written to new files) before anything is
        dropped, so a ColdBlockError leaves the cache as it was.
        """
        if not 0 <= start <= end <= self._seq_len:
            raise ValueError(f"cannot remove positions {start}..{end}: the cache holds {self._seq_len}")
        removed, size = end - start, self.block_size
        if removed == 0:
            return
        self._drain()
        new_len = self._seq_len - removed
        reader = _OldPositions(self)
        fresh: list[_Block] = []
        try:
            for index in range(start // size, new_len // size):
                keys, values = reader.moved(index * size, (index + 1) * size, start, removed, rerotate)
                fresh.append(self._sealed_like(self._blocks[index], index, keys, values))
            tail = reader.moved(new_len // size * size, new_len, start, removed, rerotate)
        except BaseException:
            for block in fresh:
                if block.path is not None:
                    block.path.unlink(missing_ok=True)
            raise
        for index in range(start // size, len(self._blocks)):  # replaced blocks keep their LRU rank
            if self._blocks[index].path is not None:
                self._blocks[index].path.unlink(missing_ok=True)
            if index >= new_len // size:
                self._lru.pop(index, None)
        self._blocks[start // size :] = fresh
        self._tail_k[:, :, : tail[0].shape[2]], self._tail_v[:, :, : tail[1].shape[2]] = tail
        self._seq_len, self._removed = new_len, self._removed + removed
        self._rebalance()

    def _sealed_like(self, old: _Block, index: int, keys: torch.Tensor, values: torch.Tensor) -> _Block:
        """A new sealed block of K, V [L, H, bs, D] in `old`'s tier (cold: written to a new file)."""
        if old.tier == "hot":
            return _Block("hot", (keys, values))
        packed = pack(keys, values, self.warm_dtype)
        if old.tier == "warm":
            return _Block("warm", warm=packed)
        block = _Block("cold", path=self._new_path(index))
        write_block(block.path, packed)
        self.stats["files_written"] += 1
        return block

    def _forget(self, index: int) -> None:
        block = self._blocks[index]
        if block.path is not None:
            block.path.unlink(missing_ok=True)
        self._lru.pop(index, None)

    def release(self) -> None:
        """Drop everything: blocks, files, the directory and the reader threads."""
        self._drain()
        self._blocks.clear()
        self._lru.clear()
        self._seq_len = self._removed = 0
        if self._finalizer is not None:
            self._finalizer()  # removes the directory and every file in it
            self._finalizer, self._dir = None, None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    close = release

    def __enter__(self) -> "TieredCache":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def fork(self) -> "TieredCache":
        """Sealed blocks are immutable, so hot and warm ones are shared; cold files are copied into
        the twin's own directory (each cache deletes only what it created)."""
        self._drain()
        twin = TieredCache(self.spec, self.block_size, self.hot_blocks * self.block_size,
                           self.warm_blocks * self.block_size, self.warm_dtype, self.parent_dir, self.prefetch_workers)  # fmt: skip
        for index, block in enumerate(self._blocks):
            copy = _Block(block.tier, block.hot, block.warm)
            if block.path is not None:
                copy.path = twin._new_path(index)
                shutil.copyfile(block.path, copy.path)
            twin._blocks.append(copy)
        twin._lru = OrderedDict(self._lru)
        twin._tail_k, twin._tail_v = self._tail_k.clone(), self._tail_v.clone()
        twin._seq_len, twin._removed = self._seq_len, self._removed
        return twin

    def copy_prefix(self, source: KVCache, num_tokens: int) -> None:
        """Take `source`'s first positions: a fork of it (its own copies of cold files), truncated."""
        self._check_copy_source(source, num_tokens)
        twin = source.fork()
        twin.truncate(num_tokens)
        self.release()
        self.block_size, self.warm_dtype = twin.block_size, twin.warm_dtype
        self._blocks, self._lru, self._seq_len = twin._blocks, twin._lru, twin._seq_len
        self._removed = source.positions_removed if num_tokens == source.seq_len else 0  # as ContiguousCache
        self._tail_k, self._tail_v = twin._tail_k, twin._tail_v
        if twin._finalizer is not None:  # the files now belong to this cache: so does their cleanup
            twin._finalizer.detach()
            self._dir, self._files_created = twin._dir, twin._files_created
            self._finalizer = weakref.finalize(self, shutil.rmtree, self._dir, True)
        twin._blocks, twin._finalizer, twin._dir = [], None, None

    def check_invariants(self) -> None:
        super().check_invariants()
        assert 0 <= self._seq_len - self._sealed_end < self.block_size, f"tail of {self._seq_len - self._sealed_end} positions"
        assert list(sorted(self._lru)) == list(range(len(self._blocks))), "LRU does not list every block once"
        counts = {tier: self.tiers().count(tier) for tier in TIERS}
        assert counts["hot"] <= self.hot_blocks and counts["warm"] <= self.warm_blocks, f"over budget: {counts}"
        for index, block in enumerate(self._blocks):
            assert (block.hot is not None) == (block.tier == "hot"), f"block {index} hot tensors vs tier {block.tier}"
            assert (block.warm is not None) == (block.tier == "warm"), f"block {index} warm pack vs tier {block.tier}"
            if block.tier == "cold":
                assert block.path is not None and block.path.exists(), f"cold block {index} has no file"
        if self._dir is not None:
            files = {p for p in self._dir.iterdir()}
            assert files == {b.path for b in self._blocks if b.path is not None}, "stray or missing cold files"


class _OldPositions:
    """Reads a tiered cache's positions as they are before a remove_range, one old block at a time
    (kept until the next is needed: the reads go forward), and gives them at their new places."""

    def __init__(self, cache: TieredCache):
        self.cache = cache
        self._held: tuple[int, tuple[torch.Tensor, torch.Tensor]] | None = None  # (block, its K, V)

    def moved(self, first: int, last: int, start: int, removed: int,
              rerotate: Rerotate) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """New positions first..last-1 after removing start..start+removed-1: K, V [L, H, n, D],
        the keys of moved positions turned by -removed."""
        kept_k, kept_v = self.read(first, max(first, min(last, start)))
        moved_k, moved_v = self.read(max(first, start) + removed, max(first, start, last) + removed)
        if moved_k.shape[2]:
            moved_k = torch.cat([rerotate(layer, moved_k[layer, None], -removed) for layer in range(moved_k.shape[0])])
        return torch.cat((kept_k, moved_k), 2), torch.cat((kept_v, moved_v), 2)

    def read(self, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Old positions first..last-1: K, V [L, H, n, D] fp32 (blocks from their tier, then the tail)."""
        cache, size = self.cache, self.cache.block_size
        keys, values, position = [], [], first
        while position < last:
            index = position // size
            if index < len(cache._blocks):
                if self._held is None or self._held[0] != index:
                    self._held = (index, cache._block_fp32(index, cache._blocks[index]))
                block_k, block_v = self._held[1]
                where = slice(position - index * size, min(size, last - index * size))
            else:
                block_k, block_v = cache._tail_k, cache._tail_v
                where = slice(position - cache._sealed_end, last - cache._sealed_end)
            keys.append(block_k[:, :, where])
            values.append(block_v[:, :, where])
            position += where.stop - where.start
        if not keys:
            empty = cache._tail_k[:, :, :0]
            return empty, empty
        return torch.cat(keys, 2), torch.cat(values, 2)
