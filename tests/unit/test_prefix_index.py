"""PrefixIndex over a real BlockPool: exact matches, lock/unlock, LRU and LFU eviction order,
stats and miss reasons; pool reference counts stay exact through random operation sequences."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgen.kv.block_pool import BlockPool
from kvgen.kv.prefix import PrefixIndex

SIZE = 4


def sequence_blocks(pool: BlockPool, tokens: list[int]):
    """A finished sequence's blocks (one per SIZE tokens), as a request would hold them."""
    return pool.allocate(pool.blocks_for(len(tokens)))


def test_match_returns_the_longest_full_block_prefix() -> None:
    pool = BlockPool(16, SIZE)
    index = PrefixIndex(pool)
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    blocks = sequence_blocks(pool, tokens)
    index.insert(tokens, blocks)
    assert index.num_blocks == 2 and [b.ref_count for b in blocks] == [2, 2, 1]
    match = index.match(list(range(8)) + [99, 98, 97, 96])
    assert match.blocks == blocks[:2] and match.reason == "hit"
    assert index.match(list(range(8)), max_tokens=7).blocks == blocks[:1]  # the last token is never served
    assert index.match([0, 1, 2, 5, 4, 5, 6, 7]).reason == "no match"
    assert index.match([0, 1]).reason == "too short"
    assert index.stats.hits == 2 and index.stats.misses == 2 and index.stats.tokens_reused == 12
    pool.free(blocks)
    index.check_invariants()
    pool.check_invariants()


def test_salts_keep_namespaces_apart() -> None:
    pool = BlockPool(8, SIZE)
    index = PrefixIndex(pool)
    tokens = list(range(8))
    index.insert(tokens, sequence_blocks(pool, tokens), salt="adapter-a")
    assert index.match(tokens, salt="adapter-a").num_blocks == 2
    miss = index.match(tokens, salt="adapter-b")
    assert miss.num_blocks == 0 and miss.reason == "different salt"


def test_unseen_and_emptied_salts_hold_no_root() -> None:
    """A server may get a new cache salt per request: only salts with indexed blocks keep a root."""
    pool = BlockPool(8, SIZE)
    index = PrefixIndex(pool)
    tokens = list(range(8))
    for i in range(100):
        assert index.match(tokens, salt=f"user-{i}").num_blocks == 0
    assert index.roots == {}
    blocks = sequence_blocks(pool, tokens)
    index.insert(tokens, blocks, salt="user-1")
    pool.free(blocks)
    assert list(index.roots) == ["user-1"]
    index.clear()
    assert index.roots == {} and index.num_blocks == 0
    assert index.match(tokens, salt="user-1").reason == "evicted"
    index.check_invariants()
    pool.check_invariants()


@pytest.mark.parametrize("policy, expected_first", [("lru", "old"), ("lfu", "new")])
def test_eviction_order_lru_and_lfu(policy: str, expected_first: str) -> None:
    pool = BlockPool(8, SIZE)
    index = PrefixIndex(pool, policy)
    paths = {"old": [1, 1, 1, 1], "new": [2, 2, 2, 2]}
    for name in ("old", "new"):
        blocks = sequence_blocks(pool, paths[name])
        index.insert(paths[name], blocks)
        pool.free(blocks)  # the request ended: only the index holds them
    for _ in range(3):
        index.match(paths["old"])  # "old" is used often, but "new" was used last
    index.match(paths["new"])
    assert index.evict(1) == 1
    survivor = "new" if expected_first == "old" else "old"
    assert index.match(paths[expected_first]).reason == "evicted"
    assert index.match(paths[survivor]).num_blocks == 1
    assert pool.num_free == 7 and index.stats.evictions == 1


def test_locked_paths_are_never_evicted_and_leaves_go_first() -> None:
    pool = BlockPool(8, SIZE)
    index = PrefixIndex(pool)
    tokens = list(range(12))
    blocks = sequence_blocks(pool, tokens)
    node = index.insert(tokens, blocks)
    pool.free(blocks)
    index.lock(node)
    assert index.evict(3) == 0 and pool.num_free == 5
    index.unlock(node)
    assert index.evict(1) == 1
    assert index.match(tokens).num_blocks == 2  # the leaf (last block) went, its parents stayed
    assert index.evict(10) == 2 and pool.num_free == 8 and index.num_blocks == 0
    index.check_invariants()
    pool.check_invariants()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("ime"), st.lists(st.integers(0, 2), min_size=1, max_size=14)), max_size=25))
def test_random_operations_keep_reference_counts_exact(ops) -> None:
    pool = BlockPool(12, SIZE)
    index = PrefixIndex(pool)
    for op, tokens in ops:
        if op == "i":
            blocks = pool.allocate(pool.blocks_for(len(tokens)))
            if blocks is None:
                index.evict(pool.blocks_for(len(tokens)))
                continue
            node = index.insert(tokens, blocks)
            index.lock(node)
            index.unlock(node)
            pool.free(blocks)
        elif op == "m":
            match = index.match(tokens)
            assert all(b.ref_count >= 1 for b in match.blocks)
        else:
            index.evict(len(tokens))
        index.check_invariants()
        pool.check_invariants()
        assert pool.num_free + index.num_blocks == pool.num_blocks
