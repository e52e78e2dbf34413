"""PagedPool, the pool-level contract: exact block ids, None when full with nothing changed, padded
block tables, and random operation sequences against a plain Python model of the pool."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvgen.kv import CacheSpec
from kvgen.kv.block_pool import BlockPool
from kvgen.kv.paged import PagedStorage
from kvgen.kv.paged_pool import PagedPool
from kvgen.kv.pool import PAD_BLOCK

SPEC = CacheSpec(num_layers=2, num_kv_heads=1, head_dim=2)


def new_pool(num_blocks: int = 8, block_size: int = 4) -> PagedPool:
    return PagedPool(PagedStorage(SPEC, BlockPool(num_blocks, block_size)))


def write(pool: PagedPool, request_id: str, values: list[int]) -> list[int]:
    """A forward pass of len(values) tokens whose keys are `values`; layer 0's keys afterwards."""
    cache = pool.cache(request_id)
    keys = torch.tensor(values, dtype=torch.float32)[None, None, :, None].expand(1, 1, len(values), 2)
    seen = [cache.update(layer, keys, -keys)[0] for layer in range(SPEC.num_layers)]
    cache.commit(len(values))
    return seen[0][0, 0, :, 0].int().tolist()


def test_allocate_returns_block_tables_and_none_when_full_without_change() -> None:
    pool = new_pool(num_blocks=4, block_size=4)
    assert pool.allocate("a", 6) == [0, 1]
    assert pool.allocate("b", 4) == [2]
    assert pool.allocate("c", 9) is None  # needs 3 blocks, 1 free
    assert pool.request_ids == ["a", "b"] and pool.num_free_blocks == 1
    assert pool.extend("b", 9) is None  # 9 after 0 committed needs 3 blocks: b holds 1, 1 is free
    assert pool.block_tables(["b"]).tables.tolist() == [[2]]
    assert pool.extend("b", 8) == [2, 3]
    pool.check_invariants()


def test_free_is_idempotent_and_unknown_ids_are_clear_errors() -> None:
    pool = new_pool()
    pool.allocate("a", 5)
    pool.free("a")
    pool.free("a")  # already freed: nothing happens
    assert pool.num_free_blocks == 8
    with pytest.raises(ValueError, match="request 'zz' was never allocated: allocate it first"):
        pool.free("zz")
    with pytest.raises(ValueError, match="request 'a' was freed"):
        pool.extend("a", 1)
    pool.allocate("x", 1)
    with pytest.raises(ValueError, match="already allocated"):
        pool.allocate("x", 1)
    with pytest.raises(ValueError, match="num_tokens must be >= 0"):
        pool.allocate("y", -1)
    assert pool.request_ids == ["x"]
    pool.check_invariants()


def test_block_tables_are_padded_with_lengths() -> None:
    pool = new_pool(block_size=4)
    pool.allocate("a", 9)
    pool.allocate("b", 2)
    write(pool, "a", list(range(9)))
    write(pool, "b", [7])
    tables = pool.block_tables(["b", "a"])
    assert tables.tables.tolist() == [[3, PAD_BLOCK, PAD_BLOCK], [0, 1, 2]]
    assert tables.lengths.tolist() == [1, 9] and tables.block_size == 4
    # What a batched kernel reads: position p of row b in block tables[b, p // 4] at p % 4.
    store = pool.storage.keys[0, :, 0, :, 0]  # [N, bs] layer 0, head 0, dim 0
    row = tables.tables[1]
    assert [int(store[row[p // 4], p % 4]) for p in range(9)] == list(range(9))


def test_fork_shares_blocks_and_extend_copies_the_shared_tail_first() -> None:
    pool = new_pool(num_blocks=8, block_size=4)
    pool.allocate("a", 6)
    write(pool, "a", [1, 2, 3, 4, 5, 6])
    pool.fork("a", "b")
    assert pool.block_tables(["a", "b"]).tables.tolist() == [[0, 1], [0, 1]]
    assert pool.extend("b", 1) == [0, 2]  # block 1 is shared and will be written: b gets a copy now
    assert write(pool, "b", [70]) == [1, 2, 3, 4, 5, 6, 70]
    assert write(pool, "a", [50]) == [1, 2, 3, 4, 5, 6, 50]
    pool.free("a")
    assert pool.num_free_blocks == 6  # block 0 still held by b
    pool.check_invariants()


class PoolVersusPlainModel(RuleBasedStateMachine):
    """Random allocate / extend / write / fork / truncate / free against a model where a request is a
    list of abstract block labels (a fork copies the list, copy-on-write gives a fresh label)."""

    NUM_BLOCKS, BLOCK_SIZE = 12, 3

    def __init__(self) -> None:
        super().__init__()
        self.pool = new_pool(self.NUM_BLOCKS, self.BLOCK_SIZE)
        self.labels: dict[str, list[int]] = {}  # request -> labels of its blocks
        self.contents: dict[str, list[int]] = {}  # request -> committed key values
        self.freed: set[str] = set()
        self.next_label = self.next_value = 0

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.BLOCK_SIZE)

    def _free_in_model(self) -> int:
        return self.NUM_BLOCKS - len({label for labels in self.labels.values() for label in labels})

    def _fresh(self, count: int) -> list[int]:
        self.next_label += count
        return list(range(self.next_label - count, self.next_label))

    def _model_extend(self, request: str, num_new: int) -> bool:
        labels, seq = self.labels[request], len(self.contents[request])
        end = seq + num_new
        missing = max(0, self._blocks(end) - len(labels))
        counts = [label for other in self.labels.values() for label in other]
        written = range(seq // self.BLOCK_SIZE, min(len(labels), self._blocks(end))) if num_new else range(0)
        shared = [i for i in written if counts.count(labels[i]) > 1]
        if missing + len(shared) > self._free_in_model():
            return False
        for i in shared:
            labels[i] = self._fresh(1)[0]
        labels.extend(self._fresh(missing))
        return True

    requests = st.sampled_from(["a", "b", "c", "d"])

    @rule(request=requests, num_tokens=st.integers(0, 14))
    def allocate(self, request: str, num_tokens: int) -> None:
        if request in self.labels:
            with pytest.raises(ValueError, match="already allocated"):
                self.pool.allocate(request, num_tokens)
            return
        table = self.pool.allocate(request, num_tokens)
        if self._blocks(num_tokens) > self._free_in_model():
            assert table is None
            return
        assert table is not None and len(table) == self._blocks(num_tokens)
        self.labels[request], self.contents[request] = self._fresh(len(table)), []
        self.freed.discard(request)

    @rule(request=requests, num_new=st.integers(0, 7))
    def extend_and_write(self, request: str, num_new: int) -> None:
        if request not in self.labels:
            with pytest.raises(ValueError, match="allocate it first"):
                self.pool.extend(request, num_new)
            return
        expected = self._model_extend(request, num_new)
        table = self.pool.extend(request, num_new)
        assert (table is not None) == expected
        if table is None or num_new == 0:
            return
        values = list(range(self.next_value, self.next_value + num_new))
        self.next_value += num_new
        self.contents[request] += values
        assert write(self.pool, request, values) == self.contents[request]

    @precondition(lambda self: self.labels)
    @rule(data=st.data(), target_id=requests)
    def fork(self, data: st.DataObject, target_id: str) -> None:
        source = data.draw(st.sampled_from(sorted(self.labels)))
        if target_id in self.labels:
            with pytest.raises(ValueError, match="already allocated"):
                self.pool.fork(source, target_id)
            return
        self.pool.fork(source, target_id)
        self.labels[target_id] = list(self.labels[source])
        self.contents[target_id] = list(self.contents[source])
        self.freed.discard(target_id)

    @precondition(lambda self: self.labels)
    @rule(data=st.data(), keep=st.integers(0, 20))
    def truncate(self, data: st.DataObject, keep: int) -> None:
        request = data.draw(st.sampled_from(sorted(self.labels)))
        keep = min(keep, len(self.contents[request]))
        self.pool.truncate(request, keep)
        del self.labels[request][self._blocks(keep) :]
        del self.contents[request][keep:]

    @rule(request=requests)
    def free(self, request: str) -> None:
        if request not in self.labels and request not in self.freed:
            with pytest.raises(ValueError, match="never allocated"):
                self.pool.free(request)
            return
        self.pool.free(request)
        self.labels.pop(request, None)
        self.contents.pop(request, None)
        self.freed.add(request)

    @invariant()
    def matches_the_model(self) -> None:
        self.pool.check_invariants()
        assert self.pool.num_free_blocks == self._free_in_model()
        assert sorted(self.pool.request_ids) == sorted(self.labels)
        label_to_block: dict[int, int] = {}
        for request, labels in self.labels.items():
            table = self.pool.block_tables([request])
            assert table.lengths.tolist() == [len(self.contents[request])]
            for label, block in zip(labels, table.tables[0].tolist(), strict=True):
                assert label_to_block.setdefault(label, block) == block, "sharing differs from the model"
        assert len(set(label_to_block.values())) == len(label_to_block), "two labels on one block"


TestPoolVersusPlainModel = PoolVersusPlainModel.TestCase
TestPoolVersusPlainModel.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
