"""StatePrefixIndex: the engine's prefix cache for recurrent-state models (Mamba).

A state-space layer has no per-position keys and values to share: the state after token t stands
for the whole prefix 0..t. So where the K/V prefix index (kv/prefix.py) keeps one pool block per
full block of tokens, this index keeps a *snapshot* of every layer's state at block boundaries
(lengths that are multiples of `block_size`), on a tree of the blocks' exact token ids with one
root per salt. A request whose prompt starts with an indexed path copies the deepest snapshot on it
into its own state and recomputes only the tokens after it.

Snapshots are never modified and a request copies the one it resumes from, so no request pins
anything here: any snapshot can be evicted at any time, least recently used first, to keep the
index within `max_snapshots` (the engine's state budget minus the live states of running requests).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

from kvgen.kv.prefix import MissReason, PrefixStats
from kvgen.kv.ssm import States


@dataclass(eq=False)
class StateNode:
    tokens: tuple[int, ...]  # this block's token ids (empty for a root)
    parent: StateNode | None
    depth: int = 0  # blocks from the root, this one included
    children: dict[tuple[int, ...], StateNode] = field(default_factory=dict)
    snapshot: States | None = None  # every layer's state after the path's tokens, if kept


@dataclass
class StateMatch:
    num_tokens: int  # the length the snapshot stands for (0: nothing matched)
    snapshot: States | None
    reason: MissReason


class StatePrefixIndex:
    def __init__(self, block_size: int, max_snapshots: int):
        if block_size < 1 or max_snapshots < 0:
            raise ValueError(f"block_size must be >= 1 and max_snapshots >= 0, got {block_size}, {max_snapshots}")
        self.block_size, self.max_snapshots = block_size, max_snapshots
        self._roots: dict[str, StateNode] = {}
        self._kept: OrderedDict[int, StateNode] = OrderedDict()  # id(node) -> node with a snapshot, LRU first
        self._clock = itertools.count()
        self.stats = PrefixStats()

    @property
    def num_snapshots(self) -> int:
        return len(self._kept)

    @property
    def num_blocks(self) -> int:
        """What the engine's metrics call the index's entries: here, snapshots."""
        return self.num_snapshots

    @property
    def num_held(self) -> int:
        """What the pool's blocks in use count for the index (PrefixIndex.num_held): snapshots."""
        return self.num_snapshots

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
        return StateMatch(best.depth * self.block_size, best.snapshot, "hit")

    def insert(self, tokens: list[int], snapshots: dict[int, States], salt: str = "") -> int:
        """Keep the snapshots taken at block boundaries of `tokens` (length -> every layer's state
        after tokens[:length]); others are ignored, as are lengths already kept. Returns how many
        were added (the least recently used go when the index is over `max_snapshots`)."""
        added = 0
        for length, snapshot in sorted(snapshots.items()):
            if length % self.block_size or not 0 < length <= len(tokens) or self.max_snapshots == 0:
                continue
            node = self._roots.setdefault(salt, StateNode((), None))
            for chunk in self._chunks(tokens, length):
                child = node.children.get(chunk)
                if child is None:
                    child = node.children[chunk] = StateNode(chunk, node, node.depth + 1)
                node = child
            if node.snapshot is None:
                node.snapshot = snapshot
                added += 1
            self._kept[id(node)] = node
            self._kept.move_to_end(id(node))
        self.evict(self.num_snapshots - self.max_snapshots)
        return added

    def evict(self, count: int) -> int:
        """Drop `count` snapshots, least recently used first (their path nodes go when bare)."""
        evicted = 0
        while evicted < count and self._kept:
            _, node = self._kept.popitem(last=False)
            node.snapshot = None
            evicted += 1
            while node.parent is not None and not node.children and node.snapshot is None:
                del node.parent.children[node.tokens]
                node = node.parent
        self.stats.evictions += evicted
        return evicted

    def clear(self) -> None:
        self.evict(self.num_snapshots)
        self._roots.clear()

    def check_invariants(self) -> None:
        assert self.num_snapshots <= self.max_snapshots, f"{self.num_snapshots} snapshots over the limit {self.max_snapshots}"
        seen = 0
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.snapshot is not None:
                seen += 1
                assert id(node) in self._kept, "a snapshot the LRU order does not know"
            for chunk, child in node.children.items():
                assert child.parent is node and child.tokens == chunk and child.depth == node.depth + 1, "broken tree"
                assert len(chunk) == self.block_size, "a partial block in the tree"
                stack.append(child)
        assert seen == self.num_snapshots, f"{seen} snapshots in the tree, {self.num_snapshots} in the LRU order"
