"""StatePrefixIndex: the engine's prefix cache for recurrent-state models (Mamba, and hybrids).

A state-space layer has no per-position keys and values to share: the state after token t stands
for the whole prefix 0..t. So where the K/V prefix index (kv/prefix.py) keeps one pool block per
full block of tokens, this index keeps a *snapshot* of every layer's state at block boundaries
(lengths that are multiples of `block_size`), on a tree of the blocks' exact token ids with one
root per salt. A request whose prompt starts with an indexed path copies the deepest snapshot on it
into its own state and recomputes only the tokens after it.

A hybrid (Granite 4.0-H: Mamba-2 layers beside attention layers) also needs the attention
layers' keys and values before the snapshot. Each block of the tree then holds its own block of
them, so the blocks a path shares are held once, and a request resuming from a snapshot copies the
path's blocks into its cache with it.

Snapshots are never modified and a request copies the one it resumes from, so no request pins
anything here: any snapshot can be evicted at any time, least recently used first, to keep the
index within `max_units` of the engine's budget (what the running requests leave of it): a
snapshot costs `snapshot_units`, a block's keys and values `block_units` (0 without them).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from typing import Callable

import torch

from kvgen.kv.prefix import MissReason, PrefixStats
from kvgen.kv.ssm import States

KVBlock = tuple[torch.Tensor, torch.Tensor]  # one block's keys and values, every attention layer


@dataclass(eq=False)
class StateNode:
    tokens: tuple[int, ...]  # this block's token ids (empty for a root)
    parent: StateNode | None
    depth: int = 0  # blocks from the root, this one included
    children: dict[tuple[int, ...], StateNode] = field(default_factory=dict)
    snapshot: States | None = None  # every layer's state after the path's tokens, if kept
    kv: KVBlock | None = None  # a hybrid's keys and values of this block's positions


@dataclass
class StateMatch:
    num_tokens: int  # the length the snapshot stands for (0: nothing matched)
    snapshot: States | None
    reason: MissReason
    kv_blocks: list[KVBlock] = field(default_factory=list)  # a hybrid's: the path's blocks up to the snapshot


class StatePrefixIndex:
    def __init__(self, block_size: int, max_units: int, snapshot_units: int = 1, block_units: int = 0):
        if block_size < 1 or max_units < 0 or snapshot_units < 1 or block_units < 0:
            raise ValueError(f"block_size and snapshot_units must be >= 1, max_units and block_units >= 0, got "
                             f"{block_size}, {snapshot_units}, {max_units}, {block_units}")  # fmt: skip
        self.block_size, self.max_units = block_size, max_units
        self.snapshot_units, self.block_units = snapshot_units, block_units
        self._roots: dict[str, StateNode] = {}
        self._kept: OrderedDict[int, StateNode] = OrderedDict()  # id(node) -> node with a snapshot, LRU first
        self._kv_blocks = 0  # nodes holding keys and values
        self._clock = itertools.count()
        self.stats = PrefixStats()

    @property
    def num_snapshots(self) -> int:
        return len(self._kept)

    @property
    def num_units(self) -> int:
        """What the index holds in units of the engine's budget."""
        return self.num_snapshots * self.snapshot_units + self._kv_blocks * self.block_units

    @property
    def num_blocks(self) -> int:
        """What the engine's metrics call the index's entries: here, snapshots."""
        return self.num_snapshots

    @property
    def num_held(self) -> int:
        """What the pool's blocks in use count for the index (PrefixIndex.num_held): its units."""
        return self.num_units

    def _chunks(self, tokens: list[int], max_tokens: int) -> list[tuple[int, ...]]:
        size = self.block_size
        return [tuple(tokens[i : i + size]) for i in range(0, min(len(tokens), max_tokens) // size * size, size)]

    def match(self, tokens: list[int], salt: str = "", max_tokens: int | None = None) -> StateMatch:
        """The deepest snapshot on the path of `tokens[:max_tokens]`; counts in the stats."""
        limit = len(tokens) if max_tokens is None else max_tokens
        node, best = self._roots.get(salt), None
        for chunk in self._chunks(tokens, limit):
            node = node.children.get(chunk) if node is not None else None
            if node is None:
                break
            if node.snapshot is not None:
                best = node
        self.stats.queries += 1
        self.stats.tokens_queried += len(tokens)
        if best is None:
            self.stats.misses += 1
            return StateMatch(0, None, "too short" if limit < self.block_size else "no match")
        self._kept.move_to_end(id(best))
        self.stats.hits += 1
        self.stats.tokens_reused += best.depth * self.block_size
        path, node = [], best
        while node.parent is not None:
            path.append(node)
            node = node.parent
        kv_blocks = [n.kv for n in reversed(path) if n.kv is not None]
        return StateMatch(best.depth * self.block_size, best.snapshot, "hit", kv_blocks)

    def insert(self, tokens: list[int], snapshots: dict[int, States], salt: str = "",
               kv_block: Callable[[int, int], KVBlock] | None = None) -> int:  # fmt: skip
        """Keep the snapshots taken at block boundaries of `tokens` (length -> every layer's state
        after tokens[:length]); others are ignored, as are lengths already kept. kv_block(start,
        end): a hybrid's keys and values of those positions, asked for each block the tree gains.
        Returns how many were added (the least recently used go when the index is over `max_units`)."""
        added = 0
        for length, snapshot in sorted(snapshots.items()):
            if length % self.block_size or not 0 < length <= len(tokens) or self.max_units == 0:
                continue
            node = self._roots.setdefault(salt, StateNode((), None))
            for chunk in self._chunks(tokens, length):
                child = node.children.get(chunk)
                if child is None:
                    child = node.children[chunk] = StateNode(chunk, node, node.depth + 1)
                    if kv_block is not None:
                        child.kv = kv_block(node.depth * self.block_size, child.depth * self.block_size)
                        self._kv_blocks += 1
                node = child
            if node.snapshot is None:
                node.snapshot = snapshot
                added += 1
            self._kept[id(node)] = node
            self._kept.move_to_end(id(node))
        self.shrink(self.num_units - self.max_units)
        return added

    def evict(self, count: int) -> int:
        """Drop `count` snapshots, least recently used first (their path nodes go when bare)."""
        evicted = 0
        while evicted < count and self._kept:
            self._drop_oldest()
            evicted += 1
        self.stats.evictions += evicted
        return evicted

    def shrink(self, units: int) -> int:
        """Free at least `units` units (or everything), least recently used snapshots first;
        returns how many snapshots went."""
        target, evicted = self.num_units - units, 0
        while self.num_units > target and self._kept:
            self._drop_oldest()
            evicted += 1
        self.stats.evictions += evicted
        return evicted

    def _drop_oldest(self) -> None:
        _, node = self._kept.popitem(last=False)
        node.snapshot = None
        while node.parent is not None and not node.children and node.snapshot is None:
            del node.parent.children[node.tokens]
            self._kv_blocks -= node.kv is not None
            node = node.parent

    def clear(self) -> None:
        self.evict(self.num_snapshots)
        self._roots.clear()

    def check_invariants(self) -> None:
        assert self.num_units <= self.max_units, f"{self.num_units} units over the limit {self.max_units}"
        seen = blocks = 0
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.snapshot is not None:
                seen += 1
                assert id(node) in self._kept, "a snapshot the LRU order does not know"
            blocks += node.kv is not None
            assert node.parent is None or node.snapshot is not None or node.children, "a bare node left on the tree"
            for chunk, child in node.children.items():
                assert child.parent is node and child.tokens == chunk and child.depth == node.depth + 1, "broken tree"
                assert len(chunk) == self.block_size, "a partial block in the tree"
                stack.append(child)
        assert seen == self.num_snapshots, f"{seen} snapshots in the tree, {self.num_snapshots} in the LRU order"
        assert blocks == self._kv_blocks, f"{blocks} blocks of keys in the tree, {self._kv_blocks} counted"
