"""BlockPool: the accounting of a paged KV store (vLLM v1's block pool, minus the storage).

A *block* holds `block_size` consecutive positions of one sequence for every layer. Blocks are
shared by reference count (forks, prefix-cache hits); a block whose count drops to zero goes to the
tail of the free queue, and allocation takes from the head. The free queue is therefore also the
eviction order: a freed block keeps its contents (and, later, its prefix-cache hash) until it is
reused, least recently freed first. Every operation is O(1) per block.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    # Links of the free queue; both None while the block is in use.
    prev_free: Block | None = field(default=None, repr=False)
    next_free: Block | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks, head = next to reuse. O(1) popleft, append and remove
    (remove: a freed block taken back into use, e.g. a prefix-cache hit)."""

    def __init__(self, blocks: list[Block]):
        self.num_free = len(blocks)
        # Sentinels spare every operation the empty/edge checks.
        self._head, self._tail = Block(-1), Block(-1)
        chain = [self._head, *blocks, self._tail]
        for left, right in zip(chain, chain[1:]):
            left.next_free, right.prev_free = right, left

    def popleft(self) -> Block:
        if self.num_free == 0:
            raise ValueError("no free blocks")
        block = self._head.next_free
        assert block is not None
        self.remove(block)
        return block

    def append(self, block: Block) -> None:
        last = self._tail.prev_free
        assert last is not None and block.prev_free is None and block.next_free is None, f"block {block.block_id} is already queued"
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not in the free queue"
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def block_ids(self) -> list[int]:
        """Free block ids in reuse order (for tests and debugging; O(n))."""
        ids, node = [], self._head.next_free
        while node is not None and node is not self._tail:
            ids.append(node.block_id)
            node = node.next_free
        return ids


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"a block pool needs num_blocks > 0 and block_size > 0, got {num_blocks} and {block_size}")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)

    @classmethod
    def from_budget(cls, budget_mb: float, bytes_per_token: int, block_size: int) -> "BlockPool":
        """As many blocks as `budget_mb` of storage holds, for a cache of `bytes_per_token`."""
        num_blocks = int(budget_mb * 2**20) // (bytes_per_token * block_size)
        if num_blocks == 0:
            raise ValueError(
                f"a KV budget of {budget_mb} MB holds no block of {block_size} tokens "
                f"({bytes_per_token * block_size / 2**20:.2f} MB each): raise the budget or lower the block size"
            )
        return cls(num_blocks, block_size)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return self.free_queue.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, num_blocks: int) -> list[Block] | None:
        """`num_blocks` fresh blocks with ref_count 1, or None (and no change) when too few are free."""
        if num_blocks > self.num_free:
            return None
        taken = [self.free_queue.popleft() for _ in range(num_blocks)]
        for block in taken:
            block.ref_count = 1
        return taken

    def share(self, blocks: list[Block]) -> None:
        """Add a reference to each block (a fork, or a prefix-cache hit on a freed block)."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def free(self, blocks: list[Block]) -> None:
        """Drop a reference to each block. Pass a sequence's blocks in order: they are queued in
        reverse, so its last blocks are reused first and its shared prefix survives longest."""
        for block in reversed(blocks):
            assert block.ref_count > 0, f"block {block.block_id} freed more often than it was referenced"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)

    def check_invariants(self) -> None:
        queued = self.free_queue.block_ids()
        assert len(queued) == len(set(queued)) == self.num_free, "free queue has duplicates or a wrong count"
        in_queue = set(queued)
        for block in self.blocks:
            assert block.ref_count >= 0, f"block {block.block_id} has ref_count {block.ref_count}"
            assert (block.ref_count == 0) == (block.block_id in in_queue), (
                f"block {block.block_id}: ref_count {block.ref_count} but {'' if block.block_id in in_queue else 'not '}free"
            )
