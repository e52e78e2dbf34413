"""HybridPagedCache: one sequence over a pool split into layer groups (kv/layer_groups.py).

`blocks` is the anchor group's table (the full-attention layers: every position is kept); `pages[g-1]`
is window group g's table, one entry per anchor block, None where the group dropped the page. Before
a forward that starts at position p, every window group returns to the pool the pages that hold no
position a query at p or later can see. Nothing is lost: the model's mask already hides those
positions, so reads are exactly those of a pool that kept them (or of kv/window.py's WindowedCache).

Only what the engine does is allowed below the window: growing, a rewind to at least the start of
the last forward (a rejected speculative draft), and release. A rewind that would need a dropped
page, or remove_range, raises: dropped keys cannot come back.
"""

from __future__ import annotations

import torch

from kvgen.kv.block_pool import Block
from kvgen.kv.interface import KVCache, Rerotate
from kvgen.kv.paged import CacheFullError, PagedCache, PagedStorage

# A dropped page reads as this block id: never visible (the mask hides it), always finite.
DROPPED = 0


class HybridPagedCache(PagedCache):
    batch_path_only = True  # the engine's batch view reads every group's table; the C step knows one

    def __init__(self, storage: PagedStorage):
        super().__init__(storage)
        self.groups = storage.groups
        self.pages: list[list[Block | None]] = [[] for _ in range(self.groups.num_groups - 1)]
        self._page_tables = [torch.zeros(0, dtype=torch.int64) for _ in self.pages]
        # Per window group, the index below which every entry is already dropped: a decode step
        # looks only at the pages that just left the window, not at the whole history.
        self._dropped_below = [0 for _ in self.pages]

    # --- growing and dropping ---------------------------------------------------------------
    def _first_needed(self, group: int, position: int) -> int:
        return self.groups.first_block_needed(group, position, self.storage.block_size)

    def drop_unseen(self, position: int) -> None:
        """Return every window page no query at `position` or later reads."""
        freed = []
        for group, table in enumerate(self.pages, start=1):
            below = min(self._first_needed(group, position), len(table))
            for index in range(self._dropped_below[group - 1], below):
                if table[index] is not None:
                    freed.append(table[index])
                    table[index] = None
            self._dropped_below[group - 1] = max(self._dropped_below[group - 1], below)
        if freed:
            self.storage.pool.free(freed)
            self._refresh_table()

    def blocks_needed(self, num_tokens: int) -> int:
        return super().blocks_needed(num_tokens) * self.groups.num_groups  # every group's table grows alike

    def prepare_write(self, start: int, end: int) -> bool:
        self.drop_unseen(start)
        size, pool = self.storage.block_size, self.storage.pool
        wanted = pool.blocks_for(end)
        written = range(start // size, -(-end // size)) if end > start else range(0)
        tables = [self.blocks, *self.pages]
        # (table, index) of every shared page written to (copy-on-write), and every missing page.
        shared = [(t, i) for t in tables for i in written if i < len(t) and t[i] is not None and t[i].ref_count > 1]
        missing = [(t, i) for t in tables for i in range(len(t), wanted)]
        for group, table in enumerate(self.pages, start=1):
            first = self._first_needed(group, start)
            assert all(table[i] is not None for i in range(first, len(table))), "a page the next query reads was dropped"
        if shared or missing:
            fresh = pool.allocate(len(shared) + len(missing))
            if fresh is None:
                return False
            for (table, index), copy in zip(shared, fresh):
                self.storage.copy_block(table[index].block_id, copy.block_id)  # type: ignore[union-attr]
                pool.free([table[index]])  # type: ignore[list-item]  # still referenced elsewhere
                table[index] = copy
            for (table, _), page in zip(missing, fresh[len(shared) :]):
                table.append(page)  # `missing` runs in index order per table
            self._refresh_table()
        return True

    def adopt(self, blocks: list[Block], num_tokens: int, pages: list[tuple[Block | None, ...]] | None = None) -> None:
        """As PagedCache.adopt, with the window groups' pages of those blocks (`pages[i]` for
        anchor block i, None where not held); the pages a query at `num_tokens` reads must be there."""
        pages = pages if pages is not None else [(None,) * len(self.pages) for _ in blocks]
        assert len(pages) == len(blocks), "adopt() needs one page tuple per block"
        for group in range(1, self.groups.num_groups):
            first = self._first_needed(group, num_tokens)
            assert all(pages[i][group - 1] is not None for i in range(first, len(blocks))), "adopt() misses a visible page"
        super().adopt(blocks, num_tokens)
        for group, table in enumerate(self.pages, start=1):
            table[:] = [p[group - 1] if i >= self._first_needed(group, num_tokens) else None for i, p in enumerate(pages)]
        self.storage.pool.share([p for table in self.pages for p in table if p is not None])
        self._refresh_table()

    def _refresh_table(self) -> None:
        super()._refresh_table()
        if hasattr(self, "pages"):  # PagedCache.__init__ refreshes before the pages exist
            self._page_tables = [
                torch.tensor([DROPPED if p is None else p.block_id for p in t], dtype=torch.int64) for t in self.pages
            ]

    def can_resume(self, num_tokens: int) -> bool:
        if not 0 <= num_tokens <= self._seq_len:
            return False
        keep = self.storage.pool.blocks_for(num_tokens)
        return all(
            table[i] is not None
            for group, table in enumerate(self.pages, start=1)
            for i in range(self._first_needed(group, num_tokens) if num_tokens else keep, min(keep, len(table)))
        )

    def truncate(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._seq_len:
            raise ValueError(f"cannot truncate to {num_tokens}: the cache holds {self._seq_len} positions")
        if not self.can_resume(num_tokens):
            raise ValueError(
                f"cannot rewind to {num_tokens}: its sliding-window layers already dropped positions "
                "that position needs (rewind only within the last forward, or start the sequence again)"
            )
        keep = self.storage.pool.blocks_for(num_tokens)
        for table in self.pages:
            self.storage.pool.free([p for p in table[keep:] if p is not None])
            del table[keep:]
        self._dropped_below = [min(below, keep) for below in self._dropped_below]
        super().truncate(num_tokens)

    def remove_range(self, start: int, end: int, rerotate: Rerotate) -> None:
        """As PagedCache.remove_range while every window page from `start` on is held (the tail
        moves back through them); otherwise ValueError, nothing changed."""
        first = start // self.storage.block_size
        if any(p is None for table in self.pages for p in table[first:]):
            raise ValueError(f"cannot remove positions {start}..{end}: sliding-window layers already dropped "
                             "positions at or after its start")  # fmt: skip
        super().remove_range(start, end, rerotate)

    def copy_prefix(self, source: KVCache, num_tokens: int) -> None:
        """Share `source`'s whole blocks and held window pages of the prefix, copy each group's
        partial last block; ValueError when the source dropped pages a query at `num_tokens` reads."""
        self._check_copy_source(source, num_tokens)
        if not isinstance(source, HybridPagedCache) or source.storage is not self.storage:
            raise ValueError("copy_prefix between paged caches needs one shared PagedStorage")
        if not source.can_resume(num_tokens):
            raise ValueError(f"cannot copy {num_tokens} positions: the source's sliding-window layers dropped some they need")
        size, pool = self.storage.block_size, self.storage.pool
        whole, partial = divmod(num_tokens, size)
        tables = [source.blocks, *source.pages]
        copies = pool.allocate(len(tables) if partial else 0)
        if copies is None:
            raise CacheFullError("the KV block pool is full: no block left for the partial last block of the prefix")
        for table, copy in zip(tables, copies):
            self.storage.copy_block(table[whole].block_id, copy.block_id)  # type: ignore[union-attr]
        for table in tables:
            pool.share([p for p in table[:whole] if p is not None])
        pool.free(self.held_blocks())
        self.blocks = [*source.blocks[:whole], *copies[:1]]
        self.pages = [[*table[:whole], *copies[g + 1 : g + 2]] for g, table in enumerate(source.pages)]
        self._dropped_below = [0 for _ in self.pages]
        self._seq_len = num_tokens
        self._removed = source._removed if num_tokens == source.seq_len else 0
        self._refresh_table()

    def fork(self) -> "HybridPagedCache":
        twin = super().fork()
        assert isinstance(twin, HybridPagedCache)
        twin.pages = [list(table) for table in self.pages]
        self.storage.pool.share([p for table in self.pages for p in table if p is not None])
        twin._refresh_table()
        return twin

    # --- reads ----------------------------------------------------------------------------------
    def _layer_table(self, layer: int) -> torch.Tensor:
        group = self.groups.group_of[layer]
        return self._table if group == 0 else self._page_tables[group - 1]

    def group_tables(self, num_tokens: int) -> list[torch.Tensor]:
        count = self.storage.pool.blocks_for(num_tokens)
        return [self._table[:count], *(t[:count] for t in self._page_tables)]

    def held_blocks(self) -> list[Block]:
        return [*self.blocks, *(p for table in self.pages for p in table if p is not None)]

    def window_pages(self) -> list[tuple[Block | None, ...]]:
        return [tuple(t[i] if i < len(t) else None for t in self.pages) for i in range(len(self.blocks))]

    def memory_bytes(self) -> int:
        return len(self.held_blocks()) * self.storage.bytes_per_block()

    def check_invariants(self) -> None:
        super().check_invariants()
        for group, table in enumerate(self.pages, start=1):
            assert len(table) == len(self.blocks), f"group {group}'s table is not as long as the anchor's"
            first = self._first_needed(group, self._seq_len)
            assert all(table[i] is not None for i in range(first, len(table))), f"group {group} dropped a visible page"
            assert all(p.ref_count > 0 for p in table if p is not None), "a page table entry points at a free block"
