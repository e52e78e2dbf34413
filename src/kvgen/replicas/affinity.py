"""The prefix-aware choice, apart from Ray (SGLang's cache-aware router and Ray Serve's
PrefixCacheAffinityRouter are its anchors): which replica holds most of a request's prompt.

For each replica the table knows two sets of block keys (replicas/prompt_key.py): those the replica
last reported from its prefix index (exact, but a stats period old) and those of requests routed to
it since (what it will hold once they are prefilled, so that a burst of one prefix sticks to one
replica before any report). A request goes to the replica matching most of its leading blocks,
unless that replica's queue is longer than the shortest one by more than `imbalance` requests (then
to the least loaded). A request that matches nothing goes to the replica caching least among those
within `imbalance` of the shortest queue, so that different prefixes spread over the replicas and
each replica's cache holds its own share of them.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

Ranking = list[list[str]]


@dataclass
class _ReplicaKeys:
    reported: frozenset[int] = frozenset()
    version: int | None = None
    routed: OrderedDict[int, float] = field(default_factory=OrderedDict)  # key -> when, oldest first


class AffinityTable:
    def __init__(self, routed_ttl_s: float = 60.0, max_routed: int = 100_000):
        if routed_ttl_s <= 0 or max_routed < 1:
            raise ValueError("routed_ttl_s must be positive and max_routed at least 1")
        self.routed_ttl_s, self.max_routed = routed_ttl_s, max_routed
        self._replicas: dict[str, _ReplicaKeys] = {}

    def report(self, replica: str, keys: Sequence[int], version: int) -> None:
        """A replica's prefix index as it last reported it; `version` changes when the keys do, so
        that seeing the same report again (every routing decision does) costs nothing."""
        entry = self._replicas.setdefault(replica, _ReplicaKeys())
        if entry.version != version:
            entry.reported, entry.version = frozenset(keys), version

    def routed(self, replica: str, keys: Sequence[int], now: float | None = None) -> None:
        entry = self._replicas.setdefault(replica, _ReplicaKeys())
        now = time.monotonic() if now is None else now
        for key in keys:
            entry.routed[key] = now
            entry.routed.move_to_end(key)
        while len(entry.routed) > self.max_routed:
            entry.routed.popitem(last=False)

    def remove(self, replica: str) -> None:
        self._replicas.pop(replica, None)

    def keep_only(self, replicas: Sequence[str]) -> None:
        for gone in set(self._replicas) - set(replicas):
            del self._replicas[gone]

    def matched_blocks(self, replica: str, keys: Sequence[int], now: float | None = None) -> int:
        """How many of the request's leading blocks the replica holds (or soon will)."""
        entry = self._replicas.get(replica)
        if entry is None:
            return 0
        self._expire(entry, time.monotonic() if now is None else now)
        count = 0
        for key in keys:
            if key not in entry.reported and key not in entry.routed:
                break
            count += 1
        return count

    def size(self, replica: str) -> int:
        entry = self._replicas.get(replica)
        return 0 if entry is None else len(entry.reported) + len(entry.routed)

    def _expire(self, entry: _ReplicaKeys, now: float) -> None:
        while entry.routed and next(iter(entry.routed.values())) < now - self.routed_ttl_s:
            entry.routed.popitem(last=False)


def rank_replicas(keys: Sequence[int], queue_lens: dict[str, int], table: AffinityTable,
                  imbalance: int) -> tuple[Ranking, str]:  # fmt: skip
    """(ranking, why): the replica to try first, then the rest by load. why: 'prefix' (the best
    match), 'load' (the match's queue is too long, or the request has no prompt: least loaded) or
    'spread' (a new prefix: the replica caching least among those not too loaded)."""
    if not queue_lens:
        return [], "load"
    lowest = min(queue_lens.values())
    balanced = [r for r in queue_lens if queue_lens[r] - lowest <= imbalance]
    matched = {r: table.matched_blocks(r, keys) for r in queue_lens} if keys else dict.fromkeys(queue_lens, 0)
    best = max(queue_lens, key=lambda r: (matched[r], -queue_lens[r], -table.size(r)))
    if matched[best] > 0 and best in balanced:
        first, why = best, "prefix"
    elif keys and matched[best] == 0:
        first, why = min(balanced, key=lambda r: (table.size(r), queue_lens[r])), "spread"
    else:
        first, why = min(queue_lens, key=lambda r: (queue_lens[r], -matched[r], table.size(r))), "load"
    rest = sorted((r for r in queue_lens if r != first), key=lambda r: (queue_lens[r], -matched[r]))
    return [[first]] + ([rest] if rest else []), why
