"""KV caches: one contract (`KVCache`), many storage strategies."""

from kvgen.kv.block_pool import BlockPool
from kvgen.kv.contiguous import ContiguousCache
from kvgen.kv.interface import CacheSpec, KVCache, KVLayout
from kvgen.kv.paged import CacheFullError, PagedCache, PagedStorage

__all__ = ["BlockPool", "CacheFullError", "CacheSpec", "ContiguousCache", "KVCache", "KVLayout", "PagedCache", "PagedStorage"]
