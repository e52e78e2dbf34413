"""PrefixDiskTier: the prefix index's blocks spill to disk instead of being dropped, and come back.

    tier = PrefixDiskTier(index, storage, store)   # store: a DiskBlockStore (kv/disk_store.py)
    match = tier.extend(index.match(ids, salt, n), ids, salt, n)   # RAM match, continued on disk

When the index evicts a block (PrefixIndex.on_evict), its tensors (`storage.export_block`) are
written to one file, named by its *chain key*: sha256 of the parent block's key and this block's
token ids, the root key hashing the store identity (model fingerprint, weights, storage format,
block size) and the namespace (the cache salt). A key therefore names one token path of one
tenant on one model and format: tenants never share a file, and a file of another model never
matches. A prefix match that runs past the RAM nodes goes on with the next keys present on disk:
those blocks are read, verified and imported (`storage.import_block`) into fresh pool blocks and
inserted into the index, so the request adopts them like any other hit. A block that fails its
checks is dropped from the store and the request computes it instead.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass

import torch

from kvgen.kv.block_file import BlockFileError
from kvgen.kv.block_hash import chain_key
from kvgen.kv.block_pool import Block
from kvgen.kv.disk_store import DiskBlockStore
from kvgen.kv.paged import PagedStorage
from kvgen.kv.prefix import PrefixIndex, PrefixMatch, PrefixNode


@dataclass
class TierHits:
    disk_blocks: int = 0  # blocks loaded back from disk for a request
    restore_seconds: float = 0.0  # reading, verifying and importing those


class PrefixDiskTier:
    def __init__(self, index: PrefixIndex, storage: PagedStorage, store: DiskBlockStore):
        if index.pool is not storage.pool:
            raise ValueError("the disk tier needs the prefix index of the storage's own block pool")
        self.index, self.storage, self.store = index, storage, store
        self.block_size = storage.block_size
        self.hits = TierHits()
        self._identity = json.dumps(store.identity, sort_keys=True).encode()
        index.on_evict = self.spill

    # --- keys ------------------------------------------------------------------------------------
    def root_key(self, salt: str) -> bytes:
        return hashlib.sha256(b"kvgen-prefix-root\0" + self._identity + b"\0" + salt.encode()).digest()

    chain_key = staticmethod(chain_key)  # kv/block_hash.py: the chain routers of replicas use too

    def node_key(self, node: PrefixNode) -> bytes:
        """The chain key of a node (memoised on the path; a root's key is its namespace's)."""
        unkeyed = []
        while node.disk_key is None and node.parent is not None:  # a loop: paths can be thousands deep
            unkeyed.append(node)
            node = node.parent
        if node.disk_key is None:  # a root
            node.disk_key = self.root_key(next(s for s, root in self.index.roots.items() if root is node))
        for child in reversed(unkeyed):
            child.disk_key = self.chain_key(node.disk_key, child.tokens)
            node = child
        return node.disk_key

    def _metadata(self, node_parent_key: bytes, tokens: tuple[int, ...] | list[int], salt_key: bytes) -> dict[str, str]:
        return {"namespace": salt_key.hex()[:32], "parent": node_parent_key.hex(), "tokens": ",".join(map(str, tokens))}

    def _namespace(self, node: PrefixNode) -> bytes:
        while node.parent is not None:
            node = node.parent
        return self.node_key(node)

    # --- RAM -> disk -----------------------------------------------------------------------------
    def spill(self, node: PrefixNode) -> None:
        """Write an indexed block's contents (the index is about to drop it); a failed write is
        logged by the store and the block is simply dropped, as without a disk tier."""
        assert node.parent is not None and node.block is not None
        key = self.node_key(node).hex()
        if key in self.store:
            self.store.touch(key)
            return
        parts = self.storage.export_block(node.block.block_id)
        self.store.put(key, parts, self._metadata(self.node_key(node.parent), node.tokens, self._namespace(node)))

    def flush(self) -> int:
        """Write every indexed block that is not on disk yet (engine shutdown); how many were written."""
        written = 0
        for node in sorted(self.index._nodes(), key=lambda n: -n.depth):  # leaves first: see DiskBlockStore.touch
            if self.node_key(node).hex() not in self.store:
                self.spill(node)
                written += 1
        return written

    # --- disk -> RAM -----------------------------------------------------------------------------
    def extend(self, match: PrefixMatch, tokens: list[int], salt: str, max_tokens: int) -> PrefixMatch:
        """`match` continued with the blocks of `tokens[:max_tokens]` found on disk, loaded into the
        pool and indexed. Pool blocks come from free ones (or evicting unlocked index leaves)."""
        size, start = self.block_size, match.num_blocks
        wanted = self._keys_on_disk(match.node, salt, tokens, start, min(max_tokens, len(tokens)) // size)
        if not wanted:
            return match
        began = time.perf_counter()
        fresh = self._allocate(match.node, len(wanted))
        namespace, loaded = self.root_key(salt), []
        reads = self.store.get_path([(key.hex(), self._metadata(parent, chunk, namespace)) for parent, key, chunk in wanted[: len(fresh)]])
        try:
            for block, (_, key, _), parts in zip(fresh, wanted, reads):
                if not self._import(block, key, parts):
                    break
                loaded.append(block)
        finally:
            reads.close()
        self.storage.pool.free(fresh[len(loaded) :])
        if not loaded:
            return match
        for _, key, _ in reversed(wanted[: len(loaded)]):
            self.store.touch(key.hex())
        end = (start + len(loaded)) * size
        node = self.index.insert(tokens[:end], match.blocks + loaded, salt)
        self.storage.pool.free(loaded)  # the index holds them now; the request shares them next
        self.hits.disk_blocks += len(loaded)
        self.hits.restore_seconds += time.perf_counter() - began
        stats = self.index.stats
        stats.tokens_reused += len(loaded) * size
        if not match.blocks:  # the RAM index missed, the disk did not
            stats.hits, stats.misses = stats.hits + 1, stats.misses - 1
        return PrefixMatch(match.blocks + loaded, node, "hit")

    def _keys_on_disk(self, node: PrefixNode, salt: str, tokens: list[int], start: int,
                      total: int) -> list[tuple[bytes, bytes, list[int]]]:  # fmt: skip
        """(parent key, key, tokens) of the consecutive blocks start.. present on disk. A match that
        found nothing in RAM ends on a root the index may not hold yet (an unseen salt): keyed by
        the salt it came with."""
        wanted, parent = [], self.node_key(node) if node.parent is not None else self.root_key(salt)
        if not self.store.entries:
            return wanted
        for i in range(start, total):
            chunk = tokens[i * self.block_size : (i + 1) * self.block_size]
            key = self.chain_key(parent, chunk)
            if key.hex() not in self.store:
                break
            wanted.append((parent, key, chunk))
            parent = key
        return wanted

    def _allocate(self, node: PrefixNode, count: int) -> list[Block]:
        """Up to `count` fresh pool blocks, evicting unlocked index leaves (not `node`'s path)."""
        pool = self.storage.pool
        self.index.lock(node)
        try:
            if pool.num_free < count:
                self.index.evict(count - pool.num_free)
            return pool.allocate(min(count, pool.num_free)) or []
        finally:
            self.index.unlock(node)

    def _import(self, block: Block, key: bytes, parts: dict[str, torch.Tensor]) -> bool:
        try:
            self.storage.import_block(block.block_id, parts)
        except ValueError as error:  # right identity, wrong tensors: damaged
            self.store.discard(key.hex())
            self.store._skip(self.store.path(key.hex()), BlockFileError(str(error)))
            return False
        return True

    def close(self) -> None:
        """Write what the RAM index holds and release the directory."""
        try:
            self.flush()
        finally:
            self.store.close()
