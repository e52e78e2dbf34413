"""ContiguousCache: exact contents after update / commit / truncate / fork / growth."""

from __future__ import annotations

import pytest
import torch

from kvgen.kv import CacheSpec, ContiguousCache

SPEC = CacheSpec(num_layers=2, num_kv_heads=2, head_dim=4)


def kv(start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values whose every element is its position (values negative), [1, H, S, D]."""
    positions = torch.arange(start, start + length, dtype=torch.float32)[None, None, :, None]
    keys = positions.expand(1, SPEC.num_kv_heads, length, SPEC.head_dim).clone()
    return keys, -keys


def append(cache: ContiguousCache, start: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    returned = [cache.update(layer, *kv(start, length)) for layer in range(SPEC.num_layers)]
    cache.commit(length)
    return returned


def positions_of(keys: torch.Tensor) -> list[int]:
    return keys[0, 0, :, 0].int().tolist()


def test_update_returns_all_positions_without_copying() -> None:
    cache = ContiguousCache(SPEC, capacity=16)
    append(cache, 0, 5)
    keys, values = cache.update(0, *kv(5, 1))
    assert positions_of(keys) == [0, 1, 2, 3, 4, 5]
    assert positions_of(-values) == [0, 1, 2, 3, 4, 5]
    assert keys.data_ptr() == cache._keys[0].data_ptr()  # a view into the buffer


def test_seq_len_moves_only_on_commit() -> None:
    cache = ContiguousCache(SPEC, capacity=16)
    cache.update(0, *kv(0, 3))
    assert cache.seq_len == 0  # a forward that fails before commit leaves no trace
    cache.update(1, *kv(0, 3))
    cache.commit(3)
    assert cache.seq_len == 3


def test_truncate_then_overwrite() -> None:
    cache = ContiguousCache(SPEC, capacity=16)
    append(cache, 0, 6)
    cache.truncate(2)
    assert cache.seq_len == 2
    returned = append(cache, 10, 2)
    assert positions_of(returned[1][0]) == [0, 1, 10, 11]
    with pytest.raises(ValueError, match="cannot truncate to 5: the cache holds 4"):
        cache.truncate(5)


def test_growth_doubles_and_keeps_contents() -> None:
    cache = ContiguousCache(SPEC, capacity=4, max_capacity=64)
    append(cache, 0, 3)
    returned = append(cache, 3, 3)
    assert cache.capacity == 8
    assert positions_of(returned[0][0]) == [0, 1, 2, 3, 4, 5]
    append(cache, 6, 20)
    assert cache.capacity == 26  # grew to what was needed, which exceeds double
    with pytest.raises(ValueError, match="limited to 64"):
        append(cache, 26, 40)
    assert cache.seq_len == 26


def test_fork_is_independent() -> None:
    cache = ContiguousCache(SPEC, capacity=8)
    append(cache, 0, 4)
    twin = cache.fork()
    append(twin, 100, 1)
    cache.truncate(1)
    append(cache, 50, 1)
    assert positions_of(twin.update(0, *kv(7, 1))[0]) == [0, 1, 2, 3, 100, 7]
    assert positions_of(cache.update(0, *kv(7, 1))[0]) == [0, 50, 7]


def test_memory_bytes_counts_both_buffers() -> None:
    cache = ContiguousCache(SPEC, capacity=10)
    assert cache.memory_bytes() == 2 * 2 * 2 * 10 * 4 * 4  # K+V, layers, heads, slots, dim, fp32
    assert SPEC.bytes_per_token == 2 * 2 * 2 * 4 * 4
    cache.check_invariants()
