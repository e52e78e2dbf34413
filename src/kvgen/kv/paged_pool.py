"""PagedPool: the pool-level contract (kv/pool.py) over one PagedStorage.

Each request is a PagedCache over the shared storage; the pool keeps them by request id. The pool
must own its storage: check_invariants counts every block reference against these requests' tables.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import torch

from kvgen.kv.interface import CacheSpec
from kvgen.kv.paged import PagedCache, PagedStorage
from kvgen.kv.pool import PAD_BLOCK, BlockTables, KVPool, RequestId

# Freed ids remembered so a second free is a no-op rather than an "unknown id" error; bounded so a
# long-running server does not grow the set forever.
MAX_REMEMBERED_FREED = 65_536


class PagedPool(KVPool):
    def __init__(self, storage: PagedStorage):
        self.storage = storage
        self.block_size = storage.block_size
        self._requests: dict[RequestId, PagedCache] = {}
        self._freed: OrderedDict[RequestId, None] = OrderedDict()

    @classmethod
    def create(cls, spec: CacheSpec, budget_mb: float, block_size: int = 16) -> "PagedPool":
        return cls(PagedStorage.create(spec, budget_mb, block_size))

    @property
    def num_free_blocks(self) -> int:
        return self.storage.pool.num_free

    @property
    def request_ids(self) -> list[RequestId]:
        return list(self._requests)

    def _request(self, request_id: RequestId) -> PagedCache:
        if request_id not in self._requests:
            state = "was freed" if request_id in self._freed else "was never allocated"
            raise ValueError(f"request {request_id!r} {state}: allocate it first")
        return self._requests[request_id]

    @staticmethod
    def _check_count(name: str, value: int) -> None:
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")

    def _table(self, cache: PagedCache) -> list[int]:
        return [block.block_id for block in cache.blocks]

    def allocate(self, request_id: RequestId, num_tokens: int) -> list[int] | None:
        self._check_count("num_tokens", num_tokens)
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already allocated: use extend, or free it first")
        cache = PagedCache(self.storage)
        if not cache.prepare_write(0, num_tokens):
            return None
        self._requests[request_id] = cache
        self._freed.pop(request_id, None)
        return self._table(cache)

    def extend(self, request_id: RequestId, num_new_tokens: int) -> list[int] | None:
        self._check_count("num_new_tokens", num_new_tokens)
        cache = self._request(request_id)
        if not cache.prepare_write(cache.seq_len, cache.seq_len + num_new_tokens):
            return None
        return self._table(cache)

    def fork(self, source_id: RequestId, request_id: RequestId) -> None:
        source = self._request(source_id)
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already allocated: fork into a new id")
        self._requests[request_id] = source.fork()
        self._freed.pop(request_id, None)

    def truncate(self, request_id: RequestId, num_tokens: int) -> None:
        self._request(request_id).truncate(num_tokens)

    def free(self, request_id: RequestId) -> None:
        if request_id in self._freed:
            return
        self._request(request_id).release()
        del self._requests[request_id]
        self._freed[request_id] = None
        if len(self._freed) > MAX_REMEMBERED_FREED:
            self._freed.popitem(last=False)

    def cache(self, request_id: RequestId) -> PagedCache:
        return self._request(request_id)

    def block_tables(self, request_ids: Sequence[RequestId]) -> BlockTables:
        caches = [self._request(r) for r in request_ids]
        width = max((len(c.blocks) for c in caches), default=0)
        tables = torch.full((len(caches), width), PAD_BLOCK, dtype=torch.int64)  # [B, max_blocks]
        for row, cache in enumerate(caches):
            tables[row, : len(cache.blocks)] = cache._table
        lengths = torch.tensor([c.seq_len for c in caches], dtype=torch.int64)  # [B]
        return BlockTables(tables, lengths, self.block_size)

    def check_invariants(self) -> None:
        pool = self.storage.pool
        pool.check_invariants()
        references = [0] * pool.num_blocks
        for request_id, cache in self._requests.items():
            cache.check_invariants()
            for block in cache.blocks:
                references[block.block_id] += 1
        for block in pool.blocks:
            assert block.ref_count == references[block.block_id], (
                f"block {block.block_id} has ref_count {block.ref_count} but {references[block.block_id]} table entries"
            )
        assert not set(self._requests) & set(self._freed), "a request is both live and freed"
