"""The block-hash chain: one key per full block of a token path, each hashing its parent's key and
its own token ids, so a key names the whole prefix up to that block (not just the block's tokens).

The disk tier names its block files by it (kv/disk_tier.py, rooted at the store's identity); a
router of replicas compares requests with replicas' prefix indexes by it (kvgen/replicas), rooted
at the cache namespace only, as every replica serves the same model and format.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import Iterator, Sequence


def chain_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()  # int64 ids


def namespace_key(salt: str) -> bytes:
    """The root of a namespace's chains (a cache salt: tenant and cache_salt)."""
    return hashlib.sha256(b"kvgen-prefix-namespace\0" + salt.encode()).digest()


def block_chain(tokens: Sequence[int], block_size: int, root: bytes) -> Iterator[bytes]:
    """The keys of `tokens`' full blocks, first block first."""
    key = root
    for start in range(0, len(tokens) - len(tokens) % block_size, block_size):
        key = chain_key(key, tokens[start : start + block_size])
        yield key
