"""StatePrefixIndex (state snapshots at block boundaries, with a hybrid's keys and values per block)
and the SSMStateCache and HybridStateCache hooks the engine uses."""

from __future__ import annotations

import pytest
import torch

from kvgen.kv.contiguous import ContiguousCache
from kvgen.kv.hybrid import HybridStateCache
from kvgen.kv.interface import CacheSpec
from kvgen.kv.ssm import SSMSpec, SSMStateCache
from kvgen.kv.state_prefix import StatePrefixIndex

SPEC = SSMSpec(2, (1, 3, 4), (1, 3, 5))


def snapshot(value: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full(SPEC.conv_shape, value), torch.full(SPEC.state_shape, value)) for _ in range(SPEC.num_layers)]


def test_match_returns_the_deepest_snapshot_on_the_exact_path() -> None:
    index = StatePrefixIndex(block_size=4, max_units=10)
    tokens = list(range(20))
    # 6 is not a block boundary, 24 lies past the end: only 4 and 12 are kept.
    assert index.insert(tokens, {4: snapshot(4), 12: snapshot(12), 6: snapshot(6), 24: snapshot(24)}) == 2
    match = index.match(tokens + [99], max_tokens=20)
    assert match.num_tokens == 12 and match.reason == "hit" and match.snapshot[0][1][0, 0, 0].item() == 12
    assert index.match(tokens[:11] + [99] * 9).num_tokens == 4  # diverges inside the third block
    assert index.match([1] + tokens[1:]).reason == "no match"
    assert index.match(tokens[:3]).reason == "too short"
    assert index.match(tokens, salt="other").num_tokens == 0  # salts never share
    assert index.stats.hits == 2 and index.stats.misses == 3
    index.check_invariants()


def test_eviction_is_least_recently_used_and_prunes_bare_paths() -> None:
    index = StatePrefixIndex(block_size=2, max_units=2)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    index.insert(a, {2: snapshot(1)})
    index.insert(b, {4: snapshot(2)})
    index.match(a)  # a is now more recent than b
    index.insert(c, {4: snapshot(3)})  # over the limit: b's goes
    assert index.num_snapshots == 2 and index.match(b).num_tokens == 0 and index.match(a).num_tokens == 2
    assert index.evict(5) == 2 and index.num_snapshots == 0
    index.check_invariants()


def test_state_cache_hands_checkpoints_over_and_restores_from_one() -> None:
    cache = SSMStateCache(SPEC, checkpoint_every=4, max_checkpoints=8)

    def advance(count: int, value: float) -> None:
        for layer in range(SPEC.num_layers):
            cache.write(layer, torch.full(SPEC.conv_shape, value), torch.full(SPEC.state_shape, value))
        cache.commit(count)

    advance(4, 1.0)
    assert cache.take_checkpoints().keys() == {4} and cache.checkpoints == [0]
    advance(3, 2.0)  # 7: less than checkpoint_every past the last one handed over
    assert cache.take_checkpoints() == {}
    advance(1, 3.0)  # 8: the cadence goes on from 4
    taken = cache.take_checkpoints()
    assert list(taken) == [8]
    twin = SSMStateCache(SPEC, checkpoint_every=4)
    twin.restore(8, taken[8])
    assert twin.seq_len == 8 and twin.recurrent_state(1)[0, 0, 0].item() == 3.0
    twin.recurrent_state(0).add_(1)  # the live state is a copy: the snapshot is never modified
    assert taken[8][0][1][0, 0, 0].item() == 3.0
    with pytest.raises(ValueError, match="empty cache"):
        twin.restore(4, taken[8])


def test_a_hybrid_path_keeps_each_blocks_keys_once_and_restores_a_cache_from_them() -> None:
    """A hybrid's snapshots come with the keys and values of every block on their path: a snapshot
    costs its units, each block its positions; a shared block is held once and outlives the
    shallower snapshot evicted before it; a cache restored from the deepest snapshot holds its
    states and every position's keys and values."""
    kv_spec = CacheSpec(num_layers=2, num_kv_heads=1, head_dim=3)
    source = HybridStateCache(SPEC, ContiguousCache(kv_spec, 16), checkpoint_every=4)
    keys = torch.arange(2 * 12 * 3, dtype=torch.float32).reshape(2, 1, 1, 12, 3)
    for layer in range(2):
        source.kv.update(layer, keys[layer], -keys[layer])
        source.write(layer, torch.full(SPEC.conv_shape, 1.0), torch.full(SPEC.state_shape, 1.0))
    source.commit(12)
    index = StatePrefixIndex(block_size=4, max_units=100, snapshot_units=10, block_units=4)
    tokens = list(range(12))
    index.insert(tokens, {4: snapshot(4), 12: snapshot(12)}, kv_block=source.kv_block)
    assert index.num_units == 2 * 10 + 3 * 4  # two snapshots, three blocks
    index.insert(tokens[:8] + [50, 51, 52, 53], {12: snapshot(7)}, kv_block=source.kv_block)
    assert index.num_units == 3 * 10 + 4 * 4  # the first two blocks are shared
    assert index.shrink(1) == 1 and index.num_units == 2 * 10 + 4 * 4  # the oldest snapshot (4) goes, its block stays
    match = index.match(tokens + [99])
    assert match.num_tokens == 12 and len(match.kv_blocks) == 3
    cache = HybridStateCache(SPEC, ContiguousCache(kv_spec, 4, max_capacity=64), checkpoint_every=4)
    cache.restore(match.num_tokens, match.snapshot, match.kv_blocks)
    assert cache.seq_len == cache.kv.seq_len == 12 and cache.recurrent_state(0)[0, 0, 0].item() == 12
    none = torch.empty(1, 1, 0, 3)
    restored_keys, restored_values = cache.kv.update(1, none, none)
    assert torch.equal(restored_keys, keys[1]) and torch.equal(restored_values, -keys[1])
    with pytest.raises(ValueError, match="snapshot alone"):
        HybridStateCache(SPEC, ContiguousCache(kv_spec, 4)).restore(12, match.snapshot)
    index.check_invariants()
    index.clear()
    assert index.num_units == 0
