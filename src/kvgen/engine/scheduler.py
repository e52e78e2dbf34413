"""Scheduler: which requests run in the next forward, and with how many tokens each.

Each step has a token budget. Running requests go first, in (priority, arrival) order: a decode
costs one token, an unfinished prompt as many as fit (chunked prefill). Then waiting requests are
admitted while budget and max_num_seqs allow. Blocks are reserved before the step runs, so a forward
never meets a full pool; when the pool is short the scheduler first evicts unused prefix-cache
blocks, then preempts the lowest-priority, latest running request (its blocks are freed and it
recomputes later — prompt and outputs so far — so nothing is lost). A decode that carries
speculative drafts gets them only while budget and free blocks allow: drafts never preempt anyone.

On a pool split into layer groups (Gemma 3's sliding-window layers, kv/layer_groups.py) a running
request's full blocks are indexed as they fill, before its window pages drop out of its table: the
index keeps them (evictable) so that a later request can resume mid-way, as vLLM's hybrid allocator
keeps freed blocks cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvgen.engine.config import EngineConfig
from kvgen.engine.request import Request, RequestStatus
from kvgen.kv.disk_tier import PrefixDiskTier
from kvgen.kv.paged import PagedCache, PagedStorage
from kvgen.kv.prefix import PrefixIndex


@dataclass
class ScheduledRow:
    request: Request
    num_tokens: int


class Scheduler:
    def __init__(self, storage: PagedStorage, config: EngineConfig, new_cache: Callable[[], PagedCache] | None = None):
        self.storage, self.config = storage, config
        self.new_cache = new_cache or (lambda: PagedCache(storage))  # an empty sequence over `storage`
        self.pool = storage.pool
        self.prefix = PrefixIndex(self.pool, config.eviction, storage.groups) if config.prefix_cache else None
        self.waiting: list[Request] = []  # kept sorted by (priority, arrival)
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.disk: PrefixDiskTier | None = None  # set by the engine when it has a kv_cache_dir
        self._index_as_filled = self.prefix is not None and not storage.groups.is_single

    def add(self, request: Request) -> None:
        self.waiting.append(request)
        self.waiting.sort(key=lambda r: r.sort_key)

    def schedule(self) -> list[ScheduledRow]:
        budget, rows, preempted_before = self.config.max_tokens_per_step, [], self.num_preemptions
        self.running.sort(key=lambda r: r.sort_key)
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted by an earlier row of this loop
                continue
            count = min(request.num_pending, budget)
            if self._index_as_filled and self._filled_since_indexed(request):
                self.index_blocks(request)
            count += self._fit_draft(request, count, budget - count)
            if not self._reserve_or_preempt(request, count):
                break  # `request` itself was preempted: everyone after it already was
            rows.append(ScheduledRow(request, count))
            budget -= count
        if self.num_preemptions != preempted_before:
            return rows  # the pool is short: admit nobody until the running requests get through
        held: list[Request] = []
        while budget > 0 and self.waiting and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if self._prefix_in_flight(request):
                held.append(self.waiting.pop(0))
                continue
            self._attach_cache(request)
            count = min(request.num_pending, budget)
            if not self._reserve(request, count):
                self._detach_cache(request)  # try again next step, when running requests have moved on
                break
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            rows.append(ScheduledRow(request, count))
            budget -= count
        self.waiting[:0] = held  # back in their places, for the next step
        return rows

    def _prefix_in_flight(self, request: Request) -> bool:
        """A running request is still computing a prompt that shares at least one more full block
        with this one than the prefix index holds now: admitting it would compute those blocks a
        second time, so it waits until they are indexed (a burst of one system prompt computes it
        once)."""
        if self.prefix is None or request.miss_reason is not None:  # only first admissions wait
            return False
        size = self.storage.block_size
        prompt = request.prompt_ids
        for other in self.running:
            if other.prompt_indexed or other.salt != request.salt:
                continue
            shared = 0
            for a, b in zip(prompt, other.prompt_ids):
                if a != b:
                    break
                shared += 1
            shared = min(shared, len(prompt) - 1) // size * size  # the last token is always recomputed
            if shared >= size and self.prefix.matched_tokens(prompt, request.salt, max_tokens=shared) < shared:
                return True
        return False

    def _attach_cache(self, request: Request) -> None:
        """A fresh cache for a waiting request, starting from its longest cached prefix."""
        cache = self.new_cache()
        if self.prefix is not None:
            # The last known token is always recomputed: its logits give the next token.
            match = self.prefix.match(request.all_ids, request.salt, max_tokens=len(request.all_ids) - 1)
            if self.disk is not None:  # the match goes on with blocks kept on disk
                match = self.disk.extend(match, request.all_ids, request.salt, len(request.all_ids) - 1)
            cache.adopt(match.blocks, match.num_blocks * self.storage.block_size, match.pages)
            self.prefix.lock(match.node)
            request.prefix_node = match.node
            if request.miss_reason is None:  # first admission: what the prompt got from the cache
                request.cached_tokens, request.miss_reason = cache.seq_len, match.reason
        elif request.miss_reason is None:
            request.miss_reason = "disabled"
        request.cache = cache

    def _detach_cache(self, request: Request) -> None:
        if self.prefix is not None and request.prefix_node is not None:
            self.prefix.unlock(request.prefix_node)
        request.prefix_node = None
        if request.cache is not None:
            request.cache.release()
        request.cache = None

    def _reserve(self, request: Request, count: int) -> bool:
        """Blocks for `count` more tokens, evicting unused prefix blocks if needed."""
        assert request.cache is not None
        needed = request.cache.seq_len + count
        if request.cache.reserve(needed):
            return True
        if self.prefix is None:
            return False
        missing = request.cache.blocks_needed(needed) - self.pool.num_free
        self.prefix.evict(missing)
        return request.cache.reserve(needed)

    def _fit_draft(self, request: Request, count: int, spare_budget: int) -> int:
        """How many of the request's drafted tokens run with its `count` tokens this step: as many
        as the spare budget and the free blocks allow (the rest of the draft is dropped)."""
        speculation = request.speculation
        if speculation is None or not speculation.draft:
            return 0
        extra = min(len(speculation.draft), spare_budget) if request.is_decoding else 0
        while extra > 0 and not self._reserve(request, count + extra):
            extra -= 1
        speculation.trim(extra)
        return extra

    def _reserve_or_preempt(self, request: Request, count: int) -> bool:
        while not self._reserve(request, count):
            victim = self.running[-1]  # lowest priority, latest arrival
            self.preempt(victim)
            if victim is request:
                return False
        return True

    def preempt(self, request: Request) -> None:
        """Free a running request's blocks and queue it again (it recomputes what it had). Its full
        blocks are indexed first, so if nobody needs them meanwhile the recompute is a cache hit."""
        self.index_blocks(request)
        self.release(request)
        if request.speculation is not None:
            request.speculation.discard()
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.add(request)

    def index_blocks(self, request: Request) -> None:
        """Put the request's full, computed blocks into the prefix index; keep its path locked."""
        if self.prefix is None or request.cache is None:
            return
        computed = request.all_ids[: request.cache.seq_len]
        node = self.prefix.insert(computed, request.cache.blocks, request.salt, request.cache.window_pages())
        self.prefix.lock(node)
        if request.prefix_node is not None:
            self.prefix.unlock(request.prefix_node)
        request.prefix_node = node

    def _filled_since_indexed(self, request: Request) -> bool:
        indexed = request.prefix_node.depth if request.prefix_node is not None else 0
        return request.cache is not None and request.cache.seq_len // self.storage.block_size > indexed

    def release(self, request: Request) -> None:
        """Drop the request from the running set and free everything it holds."""
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self._detach_cache(request)

    def num_blocks_in_use(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    def check_invariants(self) -> None:
        """Every block's reference count is exactly the caches plus the index that hold it."""
        self.pool.check_invariants()
        expected = [0] * self.pool.num_blocks
        for request in self.running:
            assert request.cache is not None, f"running request {request.request_id} has no cache"
            request.cache.check_invariants()
            for block in request.cache.held_blocks():
                expected[block.block_id] += 1
        for request in self.waiting:
            assert request.cache is None, f"waiting request {request.request_id} still holds a cache"
        if self.prefix is not None:
            self.prefix.check_invariants()
            for block in self.prefix.blocks():
                expected[block.block_id] += 1
        actual = [b.ref_count for b in self.pool.blocks]
        leaked = [i for i, (e, a) in enumerate(zip(expected, actual)) if e != a]
        assert not leaked, f"blocks {leaked[:10]} have ref counts {[actual[i] for i in leaked[:10]]}, expected {[expected[i] for i in leaked[:10]]}"
