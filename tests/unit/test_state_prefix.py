"""StatePrefixIndex (state snapshots at block boundaries) and the SSMStateCache hooks the engine uses."""

from __future__ import annotations

import pytest
import torch

from kvgen.kv.ssm import SSMSpec, SSMStateCache
from kvgen.kv.state_prefix import StatePrefixIndex

SPEC = SSMSpec(2, (1, 3, 4), (1, 3, 5))


def snapshot(value: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full(SPEC.conv_shape, value), torch.full(SPEC.state_shape, value)) for _ in range(SPEC.num_layers)]


def test_match_returns_the_deepest_snapshot_on_the_exact_path() -> None:
    index = StatePrefixIndex(block_size=4, max_snapshots=10)
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
    index = StatePrefixIndex(block_size=2, max_snapshots=2)
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
