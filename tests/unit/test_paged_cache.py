"""PagedCache: exact contents across blocks, copy-on-write forks, truncation, release, and equality
with the contiguous cache on the real model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvgen import LLM, CacheConfig, SamplingParams
from kvgen.kv import CacheFullError, CacheSpec, ContiguousCache, PagedCache, PagedStorage
from kvgen.kv.block_pool import BlockPool
from tests.support.models import PROMPTS, model_path

SPEC = CacheSpec(num_layers=2, num_kv_heads=2, head_dim=4)


def storage(num_blocks: int = 8, block_size: int = 4) -> PagedStorage:
    return PagedStorage(SPEC, BlockPool(num_blocks, block_size))


def kv(start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys whose every element is its position; values the negative. [1, H, S, D]"""
    positions = torch.arange(start, start + length, dtype=torch.float32)[None, None, :, None]
    keys = positions.expand(1, SPEC.num_kv_heads, length, SPEC.head_dim).clone()
    return keys, -keys


def append(cache, start: int, length: int) -> list[int]:
    """Append positions start..start+length-1 to every layer; the positions layer 0 now returns."""
    returned = [cache.update(layer, *kv(start, length))[0] for layer in range(SPEC.num_layers)]
    cache.commit(length)
    return returned[0][0, 0, :, 0].int().tolist()


def test_positions_cross_block_boundaries_in_order() -> None:
    cache = PagedCache(storage(block_size=4))
    assert append(cache, 0, 6) == [0, 1, 2, 3, 4, 5]
    assert append(cache, 6, 5) == list(range(11))
    assert [b.block_id for b in cache.blocks] == [0, 1, 2]
    cache.check_invariants()


def test_fork_shares_blocks_and_copies_on_write() -> None:
    store = storage(num_blocks=8, block_size=4)
    parent = PagedCache(store)
    append(parent, 0, 6)  # blocks 0 (full) and 1 (half)
    child = parent.fork()
    assert [b.ref_count for b in parent.blocks] == [2, 2] and store.pool.num_free == 6
    assert append(child, 100, 1) == [0, 1, 2, 3, 4, 5, 100]  # writes into the shared block 1: copied first
    assert append(parent, 50, 1) == [0, 1, 2, 3, 4, 5, 50]
    assert child.blocks[0] is parent.blocks[0]  # the untouched full block is still shared
    assert child.blocks[1] is not parent.blocks[1]
    parent.check_invariants()
    child.check_invariants()


def test_truncate_and_release_return_whole_blocks() -> None:
    store = storage(num_blocks=8, block_size=4)
    cache = PagedCache(store)
    append(cache, 0, 10)  # 3 blocks
    cache.truncate(5)  # needs 2 blocks
    assert len(cache.blocks) == 2 and store.pool.num_free == 6
    assert append(cache, 20, 1) == [0, 1, 2, 3, 4, 20]
    cache.release()
    assert store.pool.num_free == 8 and cache.seq_len == 0
    store.pool.check_invariants()


def test_full_pool_raises_a_clear_error_and_changes_nothing() -> None:
    store = storage(num_blocks=2, block_size=4)
    cache = PagedCache(store)
    append(cache, 0, 8)
    with pytest.raises(CacheFullError, match="KV block pool is full .*raise the KV budget"):
        cache.update(0, *kv(8, 1))
    assert cache.seq_len == 8 and len(cache.blocks) == 2
    cache.check_invariants()


class PagedVersusContiguous(RuleBasedStateMachine):
    """Random appends, truncations and forks: every paged sequence returns what a contiguous cache
    given the same operations returns."""

    def __init__(self) -> None:
        super().__init__()
        self.store = storage(num_blocks=40, block_size=4)
        self.pairs = [(PagedCache(self.store), ContiguousCache(SPEC, capacity=4, max_capacity=64))]
        self.next_value = 0

    @rule(index=st.integers(0, 10), length=st.integers(1, 7))
    def append(self, index: int, length: int) -> None:
        paged, plain = self.pairs[index % len(self.pairs)]
        if plain.seq_len + length > 40:
            return
        keys, values = kv(self.next_value, length)
        self.next_value += length
        for layer in range(SPEC.num_layers):
            got, want = paged.update(layer, keys, values), plain.update(layer, keys, values)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        paged.commit(length)
        plain.commit(length)

    @rule(index=st.integers(0, 10), keep=st.integers(0, 40))
    def truncate(self, index: int, keep: int) -> None:
        paged, plain = self.pairs[index % len(self.pairs)]
        keep = min(keep, plain.seq_len)
        paged.truncate(keep)
        plain.truncate(keep)

    @precondition(lambda self: len(self.pairs) < 4)
    @rule(index=st.integers(0, 10))
    def fork(self, index: int) -> None:
        paged, plain = self.pairs[index % len(self.pairs)]
        self.pairs.append((paged.fork(), plain.fork()))

    @invariant()
    def consistent(self) -> None:
        self.store.pool.check_invariants()
        held = sum(len(p.blocks) for p, _ in self.pairs)
        shared = sum(b.ref_count for b in self.store.pool.blocks)
        assert shared == held  # every reference is some sequence's table entry
        for paged, plain in self.pairs:
            paged.check_invariants()
            assert paged.seq_len == plain.seq_len


TestPagedVersusContiguous = PagedVersusContiguous.TestCase
TestPagedVersusContiguous.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


@pytest.mark.parametrize("weights", ["fp32", "q4"])
def test_paged_tokens_equal_contiguous_on_smollm2(weights: str) -> None:
    """fp32: the torch path over gathered blocks; q4: the C decode path reading block tables."""
    path = model_path("smollm2")
    contiguous = LLM.load(path, progress=False, weights=weights)
    paged = LLM.load(path, progress=False, weights=weights, cache=CacheConfig("paged", block_size=16, budget_mb=32))
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    for prompt in PROMPTS[:3]:
        assert paged.generate(prompt, params).token_ids == contiguous.generate(prompt, params).token_ids
    pool = paged.generator.caches.paged_storage.pool
    assert pool.num_free == pool.num_blocks  # every request gave its blocks back
    pool.check_invariants()


def test_fork_and_truncate_on_the_model_match_recomputing(smollm2) -> None:
    """Fork a prompt's cache, continue both branches, and rewind: same logits as from scratch."""
    model = smollm2.model
    store = PagedStorage.create(CacheSpec.for_model(model.config), budget_mb=16, block_size=16)
    ids = smollm2.tokenizer.encode("The quick brown fox jumps over the lazy dog and then")
    with torch.inference_mode():
        base = PagedCache(store)
        model(torch.tensor([ids]), base)
        branch = base.fork()
        a = model(torch.tensor([[1010]]), base)[0, -1]
        b = model(torch.tensor([[2020]]), branch)[0, -1]
        branch.truncate(len(ids) - 3)  # rewind into the shared prefix, then continue
        c = model(torch.tensor([ids[-3:] + [3030]]), branch)[0, -1]
        for logits, tokens in ((a, ids + [1010]), (b, ids + [2020]), (c, ids + [3030])):
            fresh = model(torch.tensor([tokens]), ContiguousCache(CacheSpec.for_model(model.config), 64))[0, -1]
            torch.testing.assert_close(logits, fresh, rtol=0, atol=1e-4)
    base.release()
    branch.release()
    assert store.pool.num_free == store.pool.num_blocks


def test_abandoned_stream_frees_its_blocks() -> None:
    llm = LLM.load(model_path("smollm2"), progress=False, cache=CacheConfig("paged", budget_mb=16))
    stream = llm.stream("Once upon a time", SamplingParams(max_new_tokens=50))
    next(iter(stream))
    pool = llm.generator.caches.paged_storage.pool
    assert pool.num_free < pool.num_blocks
    stream._iterator.close()  # what garbage collection does to an abandoned generator
    assert pool.num_free == pool.num_blocks
