"""BlockPool: exact block ids, eviction order, and random operation sequences against a plain model."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvgen.kv.block_pool import BlockPool


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def test_allocation_takes_blocks_in_order_and_none_when_short() -> None:
    pool = BlockPool(num_blocks=6, block_size=16)
    first = pool.allocate(2)
    assert ids(first) == [0, 1] and all(b.ref_count == 1 for b in first)
    assert ids(pool.allocate(3)) == [2, 3, 4]
    assert pool.allocate(2) is None  # only block 5 is free: nothing is taken
    assert pool.num_free == 1 and pool.free_queue.block_ids() == [5]
    pool.check_invariants()


def test_freed_blocks_are_reused_least_recently_freed_first_tail_first() -> None:
    pool = BlockPool(num_blocks=6, block_size=4)
    a, b = pool.allocate(3), pool.allocate(3)  # a = [0, 1, 2], b = [3, 4, 5]
    pool.free(a)  # queued in reverse: the sequence's last block is reused first
    pool.free(b)
    assert pool.free_queue.block_ids() == [2, 1, 0, 5, 4, 3]
    assert ids(pool.allocate(4)) == [2, 1, 0, 5]


def test_shared_blocks_return_to_the_queue_only_when_the_last_reference_goes() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    blocks = pool.allocate(2)
    pool.share(blocks)  # a fork
    pool.free(blocks)
    assert pool.num_free == 2 and [b.ref_count for b in blocks] == [1, 1]
    pool.free(blocks)
    assert pool.free_queue.block_ids() == [2, 3, 1, 0]
    pool.check_invariants()


def test_sharing_a_freed_block_takes_it_back_from_the_queue() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    pool.share([blocks[1]])  # e.g. a prefix-cache hit on a block that still holds its tokens
    assert blocks[1].ref_count == 1 and 1 not in pool.free_queue.block_ids()
    pool.check_invariants()


def test_budget_in_megabytes() -> None:
    pool = BlockPool.from_budget(budget_mb=1, bytes_per_token=1024, block_size=16)
    assert pool.num_blocks == 64 and pool.blocks_for(17) == 2
    with pytest.raises(ValueError, match="holds no block of 16 tokens"):
        BlockPool.from_budget(budget_mb=0.001, bytes_per_token=1024, block_size=16)


class PoolMachine(RuleBasedStateMachine):
    """Random allocate / share / free sequences; a dict of ref counts is the reference."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(num_blocks=12, block_size=4)
        self.owners: list[list[int]] = []  # each entry: block ids one holder references
        self.expected_refs = {i: 0 for i in range(12)}

    @rule(count=st.integers(1, 5))
    def allocate(self, count: int) -> None:
        free_before = self.pool.num_free
        blocks = self.pool.allocate(count)
        if count > free_before:
            assert blocks is None and self.pool.num_free == free_before
            return
        assert blocks is not None and all(self.expected_refs[b.block_id] == 0 for b in blocks)
        for b in blocks:
            self.expected_refs[b.block_id] = 1
        self.owners.append(ids(blocks))

    @precondition(lambda self: self.owners)
    @rule(index=st.integers(0, 100))
    def share(self, index: int) -> None:
        held = self.owners[index % len(self.owners)]
        self.pool.share([self.pool.blocks[i] for i in held])
        for i in held:
            self.expected_refs[i] += 1
        self.owners.append(list(held))

    @precondition(lambda self: self.owners)
    @rule(index=st.integers(0, 100))
    def free(self, index: int) -> None:
        held = self.owners.pop(index % len(self.owners))
        self.pool.free([self.pool.blocks[i] for i in held])
        for i in held:
            self.expected_refs[i] -= 1

    @invariant()
    def matches_reference(self) -> None:
        self.pool.check_invariants()
        assert {b.block_id: b.ref_count for b in self.pool.blocks} == self.expected_refs
        assert self.pool.num_free == sum(1 for r in self.expected_refs.values() if r == 0)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
