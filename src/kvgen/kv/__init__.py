"""KV caches: one contract (`KVCache`), many storage strategies."""

from kvgen.kv.contiguous import ContiguousCache
from kvgen.kv.interface import CacheSpec, KVCache

__all__ = ["CacheSpec", "ContiguousCache", "KVCache"]
