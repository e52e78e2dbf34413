"""A block pool split into layer groups (kv/layer_groups.py, kv/paged_hybrid.py): window pages that no
query can see go back to the pool, every visible position reads back exactly, rewinds and forks
keep the books straight, and the prefix index resumes only where a window's pages are held."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvgen.config import ModelConfig
from kvgen.kv import CacheSpec, PagedStorage
from kvgen.kv.block_pool import BlockPool
from kvgen.kv.layer_groups import LayerGroups
from kvgen.kv.paged_hybrid import HybridPagedCache
from kvgen.kv.prefix import PrefixIndex

SPEC = CacheSpec(num_layers=3, num_kv_heads=2, head_dim=4)
WINDOW, BLOCK = 6, 4
GROUPS = LayerGroups(group_of=(0, 1, 2), slot_of=(0, 0, 0), windows=(None, WINDOW, WINDOW), width=1)


def storage(num_blocks: int = 64) -> PagedStorage:
    return PagedStorage(SPEC, BlockPool(num_blocks, BLOCK), GROUPS)


def append(cache: HybridPagedCache, start: int, length: int) -> list[list[float]]:
    """Positions start..start+length-1 on every layer (each key = its position, values = minus it);
    per layer, the keys update returned at the positions its first new query can see."""
    visible = []
    for layer in range(SPEC.num_layers):
        keys = torch.arange(start, start + length, dtype=torch.float32)[None, None, :, None].expand(1, 2, length, 4)
        got_k, got_v = cache.update(layer, keys.clone(), -keys)
        first = 0 if GROUPS.windows[GROUPS.group_of[layer]] is None else max(0, start - WINDOW + 1)
        assert torch.equal(got_v, -got_k)
        visible.append(got_k[0, 0, first:, 0].tolist())
    cache.commit(length)
    return visible


def gemma3_like(layer_types: tuple[str, ...]) -> ModelConfig:
    return ModelConfig("gemma3", 1000, 64, 128, len(layer_types), 4, 1, 16, 1e-6, 1e6, 4096,
                       sliding_window=512, layer_types=layer_types)  # type: ignore[arg-type]


def test_groups_of_a_model_with_five_local_layers_per_global_one() -> None:
    groups = LayerGroups.for_model(gemma3_like(tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(18))))
    assert groups.width == 3 and groups.num_groups == 6 and groups.windows == (None, *[512] * 5)
    assert [groups.group_of[i] for i in (5, 11, 17)] == [0, 0, 0]
    for group in range(6):  # every group fills its three slots once
        assert sorted(groups.slot_of[i] for i in range(18) if groups.group_of[i] == group) == [0, 1, 2]
    assert LayerGroups.for_model(gemma3_like(("full",) * 18)).is_single
    uneven = LayerGroups.for_model(gemma3_like(("sliding",) * 5 + ("full",) * 2))  # 2 full, 5 local: 3 local groups
    assert uneven.width == 2 and uneven.windows == (None, 512, 512, 512)


def test_window_pages_go_back_to_the_pool_and_visible_positions_read_exactly() -> None:
    store = storage()
    cache = HybridPagedCache(store)
    position = 0
    for length in (9, 1, 1, 5, 1, 7, 1):
        visible = append(cache, position, length)
        first = max(0, position - WINDOW + 1)
        assert visible[0] == list(range(position + length))
        assert visible[1] == visible[2] == list(range(first, position + length))
        position += length
        cache.check_invariants()
    anchor = store.pool.blocks_for(position)
    assert len(cache.blocks) == anchor
    held_pages = sum(p is not None for table in cache.pages for p in table)
    assert held_pages <= 2 * (-(-WINDOW // BLOCK) + 1) < 2 * anchor  # a window's worth per group, not the history
    assert store.pool.num_free == store.pool.num_blocks - len(cache.held_blocks())
    cache.release()
    assert store.pool.num_free == store.pool.num_blocks


def test_rewinding_past_a_dropped_page_is_refused_and_changes_nothing() -> None:
    cache = HybridPagedCache(storage())
    append(cache, 0, 20)
    append(cache, 20, 1)  # this forward dropped pages of positions < 20 - WINDOW + 1
    assert cache.can_resume(20) and cache.can_resume(21) and not cache.can_resume(8)
    before = (cache.seq_len, [b.block_id for b in cache.held_blocks()])
    with pytest.raises(ValueError, match="dropped positions"):
        cache.truncate(8)
    assert (cache.seq_len, [b.block_id for b in cache.held_blocks()]) == before
    cache.truncate(20)  # within the last forward: fine
    assert append(cache, 20, 2)[1] == list(range(15, 22))


def test_a_full_pool_returns_false_and_takes_nothing() -> None:
    store = storage(num_blocks=6)  # one block per group for 4 positions, then two more groups' worth
    cache = HybridPagedCache(store)
    append(cache, 0, 4)
    assert store.pool.num_free == 3
    assert not cache.reserve(8 + 1)  # three groups x two more blocks = 6 > 3 free
    assert store.pool.num_free == 3 and cache.seq_len == 4
    cache.check_invariants()


class HybridVersusPositions(RuleBasedStateMachine):
    """Random appends, rewinds (within the last forward, or to zero) and forks: every layer returns
    the positions it can see, and every block reference is some sequence's table entry."""

    def __init__(self) -> None:
        super().__init__()
        self.store = storage(num_blocks=200)
        self.caches = [HybridPagedCache(self.store)]
        self.last_append = [0]

    @rule(index=st.integers(0, 10), length=st.integers(1, 9))
    def append(self, index: int, length: int) -> None:
        i = index % len(self.caches)
        cache = self.caches[i]
        if cache.seq_len + length > 80:
            return
        start = cache.seq_len
        visible = append(cache, start, length)
        assert visible[0] == list(range(start + length))
        assert visible[1] == list(range(max(0, start - WINDOW + 1), start + length))
        self.last_append[i] = length

    @rule(index=st.integers(0, 10), back=st.integers(0, 9), to_zero=st.booleans())
    def rewind(self, index: int, back: int, to_zero: bool) -> None:
        i = index % len(self.caches)
        cache = self.caches[i]
        target = 0 if to_zero else cache.seq_len - min(back, self.last_append[i])
        assert cache.can_resume(target)
        cache.truncate(target)
        self.last_append[i] = 0

    @precondition(lambda self: len(self.caches) < 4)
    @rule(index=st.integers(0, 10))
    def fork(self, index: int) -> None:
        i = index % len(self.caches)
        self.caches.append(self.caches[i].fork())
        self.last_append.append(self.last_append[i])

    @invariant()
    def consistent(self) -> None:
        self.store.pool.check_invariants()
        held = sum(len(c.held_blocks()) for c in self.caches)
        assert sum(b.ref_count for b in self.store.pool.blocks) == held
        for cache in self.caches:
            cache.check_invariants()


TestHybridVersusPositions = HybridVersusPositions.TestCase
TestHybridVersusPositions.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)


def test_prefix_index_resumes_only_where_the_window_pages_are_held() -> None:
    store = storage()
    index = PrefixIndex(store.pool, groups=GROUPS)
    tokens = list(range(100, 128))  # 7 blocks
    cache = HybridPagedCache(store)
    append(cache, 0, 20)  # blocks 0..4; pages dropped below (20 - 6 + 1) // 4 = 3 at the next forward
    node = index.insert(tokens[:20], cache.blocks, pages=cache.window_pages())
    index.lock(node)
    append(cache, 20, 8)  # drops pages 0..2 from the cache; the index still holds them
    index.insert(tokens, cache.blocks, pages=cache.window_pages())
    cache.release()
    index.unlock(node)
    full = index.match(tokens, max_tokens=27)  # 6 whole blocks
    assert full.num_blocks == 6 and all(all(p is not None for p in pages) for pages in full.pages[4:])
    # A hit ending at block d resumes at position 4d, whose window needs the pages of blocks
    # (4d - 5) // 4 .. d - 1. Without block 2's pages a 6-block hit (blocks 4, 5) still stands;
    # without block 5's too, the deepest hit needing neither is 5 blocks (pages 3, 4).
    nodes = {node.depth: node for node in index._nodes()}
    index._drop_pages(nodes[3])
    assert index.match(tokens, max_tokens=27).num_blocks == 6
    index._drop_pages(nodes[6])
    assert index.match(tokens, max_tokens=27).num_blocks == 5
    index._drop_pages(nodes[4])
    assert index.match(tokens, max_tokens=27).num_blocks == 2  # 5 and 4 need block 3, 3 needs block 2
    index.check_invariants()
    referenced = index.blocks()
    assert all(b.ref_count == 1 for b in referenced)
    index.clear()
    assert store.pool.num_free == store.pool.num_blocks


def test_index_evicts_window_pages_of_locked_paths() -> None:
    store = storage()
    index = PrefixIndex(store.pool, groups=GROUPS)
    cache = HybridPagedCache(store)
    append(cache, 0, 16)
    node = index.insert(list(range(16)), cache.blocks, pages=cache.window_pages())
    index.lock(node)  # a running request's path: its anchor blocks stay
    cache.release()
    assert index.evict(100) == 8  # the 4 nodes' window pages (2 groups) only
    assert len(index.blocks()) == 4 and all(n.held_pages() == [] for n in index._nodes())
    index.check_invariants()
