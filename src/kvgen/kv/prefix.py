"""PrefixIndex: a radix tree over pool blocks (SGLang's radix cache with page size = block size).

Each node below a root stands for one *full* block: the `block_size` token ids it holds and the pool
Block with their keys/values, for the path of tokens from the root. A root per namespace (adapter /
cache salt) keeps requests that must not share KV apart. The index holds one pool reference on every
block it indexes, so an indexed block survives its request; `evict` drops that reference.

    match(tokens)        -> the longest indexed prefix, as blocks (caller shares them)
    insert(tokens, blocks)  indexes a sequence's full blocks (existing nodes are kept)
    lock(node) / unlock(node)  a running request pins its path: locked nodes are never evicted
    evict(num_blocks)    frees unlocked leaves, least recently used first (or least frequently: LFU)

Positions are absolute, so a block is only reusable at the same place in the same token path; the
keys stored after RoPE are therefore exact.

A pool split into layer groups (kv/layer_groups.py: Gemma 3's sliding-window layers) indexes, per
node, the anchor group's block and the window groups' pages of the same positions, where a sequence
still held them when it was indexed. A hit ending at position p needs every window group's pages
from p - window on, so `match` stops at the deepest node whose window is complete: exact, if
shorter. Window pages are evicted on their own (any node, locked or not: a running request holds
its own references to the pages it reads), before or after whole leaves in LRU order.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Literal

from kvgen.kv.block_pool import Block, BlockPool
from kvgen.kv.layer_groups import LayerGroups

EvictionPolicy = Literal["lru", "lfu"]
MissReason = Literal["hit", "no match", "evicted", "different salt", "too short"]
_EVICTED_MEMORY = 4096  # how many evicted paths the index remembers, to explain later misses


@dataclass(eq=False)
class PrefixNode:
    tokens: tuple[int, ...]  # this block's token ids (empty for a root)
    block: Block | None
    parent: PrefixNode | None
    depth: int = 0  # blocks from the root, this one included
    children: dict[tuple[int, ...], PrefixNode] = field(default_factory=dict)
    lock_ref: int = 0  # running requests whose path goes through this node
    last_access: int = 0
    hit_count: int = 0
    disk_key: bytes | None = None  # the block's chain key, set by a disk tier (kv/disk_tier.py)
    pages: tuple[Block | None, ...] = ()  # the window groups' pages of this block's positions, when held

    def held_pages(self) -> list[Block]:
        return [p for p in self.pages if p is not None]


@dataclass
class PrefixStats:
    queries: int = 0
    hits: int = 0  # queries that reused at least one block
    misses: int = 0
    evictions: int = 0  # blocks evicted
    tokens_queried: int = 0
    tokens_reused: int = 0

    @property
    def hit_rate(self) -> float:
        """Share of queried prompt tokens whose KV was reused."""
        return self.tokens_reused / self.tokens_queried if self.tokens_queried else 0.0


@dataclass
class PrefixMatch:
    blocks: list[Block]  # the matched blocks, in order (not yet shared: the caller takes its refs)
    node: PrefixNode  # the deepest matched node (a root when nothing matched)
    reason: MissReason
    pages: list[tuple[Block | None, ...]] = field(default_factory=list)  # per block, its window pages

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


class PrefixIndex:
    def __init__(self, pool: BlockPool, policy: EvictionPolicy = "lru", groups: LayerGroups | None = None):
        if policy not in ("lru", "lfu"):
            raise ValueError(f"unknown eviction policy {policy!r}: choose 'lru' or 'lfu'")
        self.pool, self.policy = pool, policy
        self.groups = groups  # None or single: one block per node, no window pages
        self.block_size = pool.block_size
        self.roots: dict[str, PrefixNode] = {}
        self.stats = PrefixStats()
        self.num_blocks = 0  # nodes (anchor blocks) the index references
        self.num_pages = 0  # window pages it references besides (a pool of layer groups)
        self._clock = itertools.count(1)
        self._evicted_paths: OrderedDict[tuple, None] = OrderedDict()
        # Called with each node about to be evicted (its block still intact): a disk tier spills it.
        self.on_evict: Callable[[PrefixNode], None] | None = None

    def root(self, salt: str = "") -> PrefixNode:
        if salt not in self.roots:
            self.roots[salt] = PrefixNode((), None, None)
        return self.roots[salt]

    def _chunks(self, tokens: list[int], limit: int) -> list[tuple[int, ...]]:
        size = self.block_size
        return [tuple(tokens[i : i + size]) for i in range(0, limit - limit % size, size)]

    def match(self, tokens: list[int], salt: str = "", max_tokens: int | None = None) -> PrefixMatch:
        """The longest indexed prefix of `tokens[:max_tokens]` in whole blocks; counts in the stats.

        Pass max_tokens = len(prompt) - 1 so the last prompt token is always computed (its logits
        pick the first output token) and never written into a shared block."""
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        # An unseen salt gets no root until something is inserted: a client sending a new cache salt
        # per request must not grow the index.
        root = node = self.roots.get(salt) or PrefixNode((), None, None)
        chunks, path, now = self._chunks(tokens, limit), [], next(self._clock)
        for chunk in chunks:
            child = node.children.get(chunk)
            if child is None:
                break
            node = child
            path.append(node)
        usable = self._usable_depth(path)
        node = path[usable - 1] if usable else root
        path = path[:usable]
        blocks = [n.block for n in path]
        for visited in _path(node):
            visited.last_access = now
            visited.hit_count += 1
        reason = "hit" if blocks else self._miss_reason(chunks, salt)
        if not blocks and node is root and chunks and chunks[0] in root.children:
            reason = "evicted"  # the path is indexed but its sliding-window pages are gone
        self.stats.queries += 1
        self.stats.tokens_queried += len(tokens)
        self.stats.tokens_reused += len(blocks) * self.block_size
        if blocks:
            self.stats.hits += 1
        else:
            self.stats.misses += 1
        return PrefixMatch(blocks, node, reason, [n.pages for n in path])

    def matched_tokens(self, tokens: list[int], salt: str = "", max_tokens: int | None = None) -> int:
        """How many tokens `match` would reuse now, without counting a query or touching the LRU."""
        limit = len(tokens) if max_tokens is None else min(max_tokens, len(tokens))
        node, path = self.roots.get(salt), []
        for chunk in self._chunks(tokens, limit) if node is not None else []:
            node = node.children.get(chunk)
            if node is None:
                break
            path.append(node)
        return self._usable_depth(path) * self.block_size

    def _usable_depth(self, path: list[PrefixNode]) -> int:
        """The deepest prefix of `path` a request can resume from: every window group's pages from
        the window's start to the end of the prefix are held (all of it, without window groups)."""
        groups = self.groups
        if groups is None or groups.is_single:
            return len(path)
        for depth in range(len(path), 0, -1):
            position = depth * self.block_size
            if all(
                len(path[i].pages) == groups.num_groups - 1 and path[i].pages[group - 1] is not None
                for group in range(1, groups.num_groups)
                for i in range(groups.first_block_needed(group, position, self.block_size), depth)
            ):
                return depth
        return 0

    def _miss_reason(self, chunks: list[tuple[int, ...]], salt: str) -> MissReason:
        if not chunks:
            return "too short"
        if (salt, chunks[0]) in self._evicted_paths:
            return "evicted"
        if any(chunks[0] in root.children for other, root in self.roots.items() if other != salt):
            return "different salt"
        return "no match"

    def insert(self, tokens: list[int], blocks: list[Block], salt: str = "",
               pages: list[tuple[Block | None, ...]] | None = None) -> PrefixNode:  # fmt: skip
        """Index the full blocks of a sequence whose first positions live in `blocks` (one per
        block_size tokens), with their window groups' `pages` when the pool has layer groups.
        Nodes that exist keep their block (and take pages they lack); everything newly indexed
        takes a pool reference. Returns the deepest node of the path."""
        node, now = self.root(salt), next(self._clock)
        pages = pages if pages is not None else [() for _ in blocks]
        for chunk, block, held in zip(self._chunks(tokens, len(tokens)), blocks, pages):
            child = node.children.get(chunk)
            if child is None:
                child = PrefixNode(chunk, block, node, node.depth + 1, pages=tuple(None for _ in held))
                node.children[chunk] = child
                self.pool.share([block])
                self.num_blocks += 1
            if any(c is None and p is not None for c, p in zip(child.pages, held)):
                taken = [p for c, p in zip(child.pages, held) if c is None and p is not None]
                self.pool.share(taken)
                self.num_pages += len(taken)
                child.pages = tuple(c if c is not None else p for c, p in zip(child.pages, held))
            child.last_access = now
            node = child
        return node

    def lock(self, node: PrefixNode) -> None:
        for visited in _path(node):
            visited.lock_ref += 1

    def unlock(self, node: PrefixNode) -> None:
        for visited in _path(node):
            assert visited.lock_ref > 0, "prefix node unlocked more often than locked"
            visited.lock_ref -= 1

    def evictable(self) -> list[PrefixNode]:
        """Unlocked leaves, and nodes holding window pages, in eviction order (shallower first
        among equals: the deepest pages are the ones a continuing conversation resumes from)."""
        nodes = [n for n in self._nodes() if (not n.children and n.lock_ref == 0) or n.held_pages()]
        if self.policy == "lfu":
            return sorted(nodes, key=lambda n: (n.hit_count, n.last_access, n.depth))
        return sorted(nodes, key=lambda n: (n.last_access, n.depth))

    def evict(self, num_blocks: int) -> int:
        """Drop up to `num_blocks` blocks (leaves first, a parent once its children are gone, and
        window pages on their own); returns how many were dropped. A dropped block goes back to
        the pool once no request holds it."""
        evicted = 0
        while evicted < num_blocks:
            candidates = self.evictable()
            if not candidates:
                break
            for node in candidates:
                if evicted >= num_blocks:
                    break
                if not node.children and node.lock_ref == 0:
                    evicted += 1 + len(node.held_pages())
                    self._remove(node)
                else:
                    evicted += self._drop_pages(node)
        self.stats.evictions += evicted
        return evicted

    def _drop_pages(self, node: PrefixNode) -> int:
        held = node.held_pages()
        self.pool.free(held)
        self.num_pages -= len(held)
        node.pages = tuple(None for _ in node.pages)
        return len(held)

    def _remove(self, leaf: PrefixNode) -> None:
        assert leaf.parent is not None and leaf.block is not None
        if self.on_evict is not None:
            self.on_evict(leaf)
        del leaf.parent.children[leaf.tokens]
        self._drop_pages(leaf)
        self.pool.free([leaf.block])
        self.num_blocks -= 1
        if leaf.depth == 1:  # remember the first block of the path, to explain a later miss
            salt = next(s for s, r in self.roots.items() if r is leaf.parent)
            self._evicted_paths[salt, leaf.tokens] = None
            while len(self._evicted_paths) > _EVICTED_MEMORY:
                self._evicted_paths.popitem(last=False)
            if not leaf.parent.children:  # an empty namespace: drop its root (roots stay <= blocks)
                del self.roots[salt]

    def clear(self) -> None:
        """Drop every unlocked block (what a fresh server would hold)."""
        self.evict(self.num_held)

    def _nodes(self) -> list[PrefixNode]:
        stack, nodes = [c for r in self.roots.values() for c in r.children.values()], []
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    @property
    def num_held(self) -> int:
        """Pool blocks the index holds a reference on: its nodes' blocks and window pages."""
        return self.num_blocks + self.num_pages

    def blocks(self) -> list[Block]:
        """Every block the index holds a reference on (window pages included)."""
        return [b for n in self._nodes() for b in (n.block, *n.held_pages()) if b is not None]

    def check_invariants(self) -> None:
        nodes = self._nodes()
        assert len(nodes) == self.num_blocks, f"index counts {self.num_blocks} blocks but holds {len(nodes)}"
        held = self.blocks()
        assert len({id(b) for b in held}) == len(held), "a block is indexed twice"
        assert len(held) == self.num_held, f"index counts {self.num_held} blocks and pages but holds {len(held)}"
        for node in nodes:
            assert node.block is not None and node.block.ref_count >= 1, "an indexed block is free in the pool"
            assert len(node.tokens) == self.block_size, "a node holds a partial block"
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()), "a child is locked more than its parent"


def _path(node: PrefixNode) -> list[PrefixNode]:
    """node and its ancestors, roots excluded."""
    path = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    return path
