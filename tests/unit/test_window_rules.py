"""Window + extra memory, chunked attention and attention sinks: exact contents, exact masks, and
random operation sequences against a plain list of the tokens each cache must still hold."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvgen.config import CacheConfig
from kvgen.kv import CacheSpec
from kvgen.kv.interface import AttentionSpan, KVCache
from kvgen.kv.sinks import SinkCache
from kvgen.kv.window import WindowedCache
from kvgen.models.layers import AttentionMask

SPEC = CacheSpec(num_layers=3, num_kv_heads=1, head_dim=2)


def shift_marker(layer: int, keys: torch.Tensor, delta: int) -> torch.Tensor:
    """Stands in for RoPE re-rotation: a key written as its position stays equal to its position."""
    return keys + delta


def append(cache: KVCache, tokens: list[int]) -> list[tuple[list[int], list[int]]]:
    """One forward pass: keys = their positions, values = the token ids; per layer (positions, ids) returned."""
    start = cache.seq_len
    keys = torch.arange(start, start + len(tokens), dtype=torch.float32)[None, None, :, None].expand(1, 1, -1, 2)
    values = torch.tensor(tokens, dtype=torch.float32)[None, None, :, None].expand(1, 1, -1, 2)
    seen = []
    for layer in range(SPEC.num_layers):
        k, v = cache.update(layer, keys, values)
        seen.append((k[0, 0, :, 0].int().tolist(), v[0, 0, :, 0].int().tolist()))
    cache.commit(len(tokens))
    return seen


def test_chunked_layers_drop_completed_chunks() -> None:
    cache = WindowedCache(SPEC, [AttentionSpan(chunk=4)] * 3, capacity=4)
    append(cache, list(range(7)))
    assert cache.visible_start(0) == 0  # 7 held < 2 x 4: not yet
    seen = append(cache, [7, 8])  # 9 held: keep from the start of position 9's chunk (8)
    assert seen[0][0] == list(range(9)) and cache.visible_start(0) == 8
    assert append(cache, [9])[0][0] == [8, 9]  # position 9 sees only its chunk: 8, 9
    assert not cache.can_resume(7) and cache.can_resume(8)
    cache.check_invariants()


def test_extra_memory_keeps_rewinds_exact() -> None:
    plain = WindowedCache(SPEC, [4, 4, 4], capacity=4)
    extra = WindowedCache(SPEC, [4, 4, 4], capacity=4, extra=3)
    for cache in (plain, extra):
        append(cache, list(range(14)))
    assert not plain.can_resume(11)
    assert all(extra.can_resume(n) for n in (11, 12, 13, 14))  # up to `extra` tokens back
    extra.truncate(11)
    assert append(extra, [99])[1] == ([8, 9, 10, 11], [8, 9, 10, 99])  # exactly the window of position 11
    with pytest.raises(ValueError, match="positions before .* were dropped; recompute .*extra memory"):
        plain.truncate(11)


def test_sinks_keep_the_first_positions_and_renumber_the_window() -> None:
    cache = SinkCache(SPEC, sinks=2, window=3, rerotate=shift_marker)
    append(cache, [10, 11, 12, 13])  # 4 held = sinks + window - 1: nothing evicted
    seen = append(cache, [14])  # 5 held, then token 12 is evicted
    assert seen[0] == ([0, 1, 2, 3, 4], [10, 11, 12, 13, 14])
    assert cache.seq_len == 4 and cache.positions_removed == 1 and cache.tokens_seen == 5
    assert append(cache, [15])[2] == ([0, 1, 2, 3, 4], [10, 11, 13, 14, 15])  # keys re-rotated to cache positions
    assert not cache.can_resume(3) and cache.can_resume(4)
    with pytest.raises(ValueError, match="2 positions were evicted"):
        cache.truncate(3)
    cache.reset()
    assert cache.seq_len == 0 and cache.positions_removed == 0
    cache.check_invariants()


@pytest.mark.parametrize(
    "span", [AttentionSpan(3), AttentionSpan(3, sinks=2), AttentionSpan(chunk=4), AttentionSpan(5, chunk=4), AttentionSpan()]
)
@pytest.mark.parametrize("query_start,num_queries,key_start", [(0, 9, 0), (6, 3, 2), (9, 1, 0), (9, 1, 8), (13, 1, 12)])
def test_masks_equal_the_rule_for_every_pair(span: AttentionSpan, query_start: int, num_queries: int, key_start: int) -> None:
    num_keys = query_start + num_queries - key_start
    mask = AttentionMask.build(query_start, num_queries, key_start, num_keys, span.window, span.sinks, span.chunk)
    for i in range(num_queries):
        q = query_start + i
        for j in range(num_keys):
            k = key_start + j
            expected = k <= q and (span.window is None or q - k < span.window or k < span.sinks)
            expected = expected and (span.chunk is None or k // span.chunk == q // span.chunk)
            if mask.mask is not None:
                allowed = bool(mask.mask[0, 0, i, j])
            else:
                allowed = k <= q if mask.is_causal else True
            assert allowed == expected, (q, k)


def test_cache_config_checks_window_options() -> None:
    with pytest.raises(ValueError, match="sinks cache needs a window"):
        CacheConfig("sinks")
    with pytest.raises(ValueError, match="chunked cache needs a chunk size"):
        CacheConfig("chunked")
    with pytest.raises(ValueError, match=r"KV option window \(--kv-window\) applies to the window / sinks / chunked"):
        CacheConfig("paged", window=8)
    with pytest.raises(ValueError, match="chunk must be a positive"):
        CacheConfig("chunked", chunk=0)
    assert CacheConfig("window", window=256, extra=8).extra == 8


class WindowRulesVersusPlainList(RuleBasedStateMachine):
    """Appends, rewinds and range removals: every key a query needs is returned, equal to the plain
    list of tokens, at its current position; a refused rewind changes nothing."""

    def make(self) -> KVCache:
        return WindowedCache(SPEC, [None, 4, AttentionSpan(3, chunk=5)], capacity=4, extra=2)

    def __init__(self) -> None:
        super().__init__()
        self.cache = self.make()
        self.tokens: list[int] = []  # token at each position the sequence has now
        self.next_token = 100
        self.only_appended = True  # extra memory promises rewinds from a state reached by appends

    def evict(self) -> None:
        """What the cache drops on its own at commit (sinks evict; windows only hide)."""

    @rule(length=st.integers(1, 6))
    def append(self, length: int) -> None:
        new = list(range(self.next_token, self.next_token + length))
        self.next_token += length
        start = len(self.tokens)
        self.tokens += new
        for layer, (positions, ids) in enumerate(append(self.cache, new)):
            first = self.cache.visible_start(layer)  # read after commit: may have moved
            span = self.cache.attention_span(layer, None)
            assert positions == list(range(positions[0], len(self.tokens)))
            if not self.cache.positions_removed:  # a removal can pull dropped positions back into a window
                assert positions[0] <= span.first_needed(start), "a key the first new query needs is gone"
            assert ids == [self.tokens[p] for p in positions]
            assert first <= len(self.tokens)
        self.evict()

    @rule(keep=st.integers(0, 40))
    def rewind(self, keep: int) -> None:
        keep = min(keep, len(self.tokens))
        if self.cache.can_resume(keep):
            self.only_appended &= keep == len(self.tokens)
            self.cache.truncate(keep)
            del self.tokens[keep:]
        else:
            with pytest.raises(ValueError, match="cannot rewind"):
                self.cache.truncate(keep)
        assert self.cache.seq_len == len(self.tokens)

    @rule(start=st.integers(0, 40), length=st.integers(0, 5))
    def remove_range(self, start: int, length: int) -> None:
        start = min(start, len(self.tokens))
        end = min(start + length, len(self.tokens))
        self.cache.remove_range(start, end, shift_marker)
        del self.tokens[start:end]
        self.only_appended &= start == end

    @invariant()
    def consistent(self) -> None:
        self.cache.check_invariants()
        assert self.cache.seq_len == len(self.tokens)
        if isinstance(self.cache, WindowedCache) and self.only_appended:
            assert all(self.cache.can_resume(n) for n in range(max(0, len(self.tokens) - 2), len(self.tokens) + 1))


class SinksVersusPlainList(WindowRulesVersusPlainList):
    SINKS, WINDOW = 2, 5

    def make(self) -> KVCache:
        return SinkCache(SPEC, self.SINKS, self.WINDOW, shift_marker)

    def evict(self) -> None:
        excess = len(self.tokens) - (self.SINKS + self.WINDOW - 1)
        if excess > 0:
            del self.tokens[self.SINKS : self.SINKS + excess]


TestWindowRulesVersusPlainList = WindowRulesVersusPlainList.TestCase
TestWindowRulesVersusPlainList.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestSinksVersusPlainList = SinksVersusPlainList.TestCase
TestSinksVersusPlainList.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
