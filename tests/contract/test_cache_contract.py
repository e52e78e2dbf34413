"""One suite, every cache: the behaviour kv/interface.py promises, checked on each implementation.

Add a cache to CACHES and it must pass all of this before anything else may use it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import pytest
import torch

from kvgen.kv import CacheSpec, ContiguousCache, KVCache, PagedCache, PagedStorage
from kvgen.kv.block_pool import BlockPool
from kvgen.kv.codecs import CastCodec
from kvgen.kv.compressed import CompressedCache
from kvgen.kv.interface import AttentionSpan
from kvgen.kv.layer_groups import LayerGroups
from kvgen.kv.paged_codes import QuantizedPagedStorage
from kvgen.kv.paged_codes_cache import QuantizedPagedCache
from kvgen.kv.paged_hybrid import HybridPagedCache
from kvgen.kv.quantized import QuantizedCache
from kvgen.kv.sinks import SinkCache
from kvgen.kv.tiered import TieredCache
from kvgen.kv.tracing import TracingCache
from kvgen.kv.window import WindowedCache

SPEC = CacheSpec(num_layers=3, num_kv_heads=2, head_dim=8)
SHARED = dataclasses.replace(SPEC, values_are_keys=True)  # one store for keys and values (latent attention)
SINK_CODEC = CastCodec("fp32", torch.float32)
SINK_CODEC.sink_tokens = 3  # keeps the first 3 positions aside, as KVQuant's codec keeps its first one
SINK_FREE_FP32 = CastCodec("fp32", torch.float32)
# Layer 0 full attention, layers 1 and 2 sliding (window 64, wider than these tests' sequences):
# three groups of one layer slot each, as the engine splits Gemma 3's pool.
GROUPS = LayerGroups(group_of=(0, 1, 2), slot_of=(0, 0, 0), windows=(None, 64, 64), width=1)
CACHES: dict[str, Callable[[], KVCache]] = {
    "contiguous": lambda: ContiguousCache(SPEC, capacity=8, max_capacity=256),
    "paged": lambda: PagedCache(PagedStorage(SPEC, BlockPool(num_blocks=64, block_size=4))),
    # Identity codecs: exercises packing in blocks (of 2 here), the residual window, truncation into
    # packed blocks and the fp32 sink, and must then equal the reference exactly.
    "quantized": lambda: QuantizedCache(SPEC, 8, 256, "fp32", "fp32", residual=3, block_tokens=2),
    "quantized(sink)": lambda: QuantizedCache(SPEC, 8, 256, SINK_CODEC, "fp32", residual=1, block_tokens=2),
    # Windows far larger than these tests' sequences: nothing is dropped, so results equal the reference.
    "window": lambda: WindowedCache(SPEC, [None, 64, 64], capacity=8),
    # An exact window wider than these tests' sequences: nothing is pooled (pooling: test_compressed_cache).
    "compressed": lambda: CompressedCache(SPEC, chunk=2, window=32, sink=1, capacity=4),
    # Blocks of 2 with one hot and one warm (lossless fp32) block: these sequences reach the disk tier.
    "tiered": lambda: TieredCache(SPEC, block_size=2, hot_tokens=2, warm_tokens=2, warm_dtype="fp32"),
    "window+extra": lambda: WindowedCache(SPEC, [None, 64, 64], capacity=8, extra=4),
    "chunked": lambda: WindowedCache(SPEC, [AttentionSpan(chunk=64)] * 3, capacity=8),
    "sinks": lambda: SinkCache(SPEC, sinks=4, window=64, rerotate=lambda layer, keys, delta: keys + delta),
    "tracing(window)": lambda: TracingCache(WindowedCache(SPEC, [None, 64, 64], capacity=8)),
    # The engine's pool of codes, fp32 codecs (exact): blocks of 4, staging slots for partial blocks,
    # copy-on-write of staged blocks, re-staging after truncation into an encoded block.
    "paged codes": lambda: QuantizedPagedCache(QuantizedPagedStorage(SPEC, BlockPool(num_blocks=64, block_size=4),
                                                                     SINK_FREE_FP32, SINK_FREE_FP32, num_slots=8)),
    "paged(layer groups)": lambda: HybridPagedCache(PagedStorage(SPEC, BlockPool(num_blocks=96, block_size=4), GROUPS)),
    "tracing(paged)": lambda: TracingCache(PagedCache(PagedStorage(SPEC, BlockPool(num_blocks=64, block_size=4)))),
    "contiguous(values are keys)": lambda: ContiguousCache(SHARED, capacity=8, max_capacity=256),
    "paged(values are keys)": lambda: PagedCache(PagedStorage(SHARED, BlockPool(num_blocks=64, block_size=4))),
}


@pytest.fixture(params=sorted(CACHES))
def cache(request: pytest.FixtureRequest) -> KVCache:
    return CACHES[request.param]()


def step(cache: KVCache, length: int, seed: int, like: KVCache | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One forward pass's worth of updates (every layer), then commit; returns what update gave.
    The values are the keys where the spec of `cache` (or of `like`, the cache a reference follows)
    says so, as latent attention writes them."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for layer in range(SPEC.num_layers):
        k = torch.randn(1, SPEC.num_kv_heads, length, SPEC.head_dim, generator=generator)
        v = torch.randn(1, SPEC.num_kv_heads, length, SPEC.head_dim, generator=generator)
        if (like or cache).spec.values_are_keys:
            v = k
        keys, values = cache.update(layer, k, v)
        out.append((keys.clone(), values.clone()))
    cache.commit(length)
    return out


def test_update_returns_history_plus_new_positions(cache: KVCache) -> None:
    first = step(cache, 5, seed=1)
    second = step(cache, 3, seed=2)
    for layer in range(SPEC.num_layers):
        keys, values = second[layer]
        assert keys.shape == (1, SPEC.num_kv_heads, 8, SPEC.head_dim)
        torch.testing.assert_close(keys[:, :, :5], first[layer][0], rtol=0, atol=0)
        torch.testing.assert_close(values[:, :, :5], first[layer][1], rtol=0, atol=0)
    assert cache.seq_len == 8
    cache.check_invariants()


def test_uncommitted_writes_do_not_count(cache: KVCache) -> None:
    step(cache, 4, seed=1)
    generator = torch.Generator().manual_seed(9)
    cache.update(0, torch.randn(1, 2, 2, 8, generator=generator), torch.randn(1, 2, 2, 8, generator=generator))
    assert cache.seq_len == 4  # a forward that died after layer 0
    again = step(cache, 2, seed=3)  # the next pass overwrites those positions
    reference = CACHES["contiguous"]()
    step(reference, 4, seed=1, like=cache)
    expected = step(reference, 2, seed=3, like=cache)
    for got, want in zip(again, expected):
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)


def test_truncate_then_continue_equals_never_having_gone_further(cache: KVCache) -> None:
    step(cache, 6, seed=1)
    step(cache, 5, seed=2)
    cache.truncate(6)
    assert cache.seq_len == 6
    continued = step(cache, 2, seed=3)
    reference = CACHES["contiguous"]()
    step(reference, 6, seed=1, like=cache)
    for got, want in zip(continued, step(reference, 2, seed=3, like=cache)):
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(100)
    cache.check_invariants()


def test_fork_is_independent_in_both_directions(cache: KVCache) -> None:
    step(cache, 5, seed=1)
    twin = cache.fork()
    assert twin.seq_len == 5
    twin_out = step(twin, 2, seed=7)
    cache_out = step(cache, 2, seed=8)
    reference = CACHES["contiguous"]()
    step(reference, 5, seed=1, like=cache)
    fork_ref = reference.fork()
    for got, want in zip(twin_out, step(fork_ref, 2, seed=7, like=cache)):
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    for got, want in zip(cache_out, step(reference, 2, seed=8, like=cache)):
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    cache.check_invariants()
    twin.check_invariants()


def test_reset_and_memory(cache: KVCache) -> None:
    step(cache, 7, seed=1)
    assert cache.memory_bytes() >= 7 * cache.spec.bytes_per_token
    cache.reset()
    assert cache.seq_len == 0
    step(cache, 3, seed=2)
    assert cache.seq_len == 3
    cache.check_invariants()


def shift_marker(layer: int, keys: torch.Tensor, delta: int) -> torch.Tensor:
    """A stand-in for RoPE re-rotation that is easy to check: moving back d positions subtracts d."""
    return keys + delta


@pytest.mark.parametrize(("start", "end"), [(2, 5), (0, 4), (5, 9), (4, 4)])
def test_remove_range_moves_the_tail_back_like_the_contiguous_cache(cache: KVCache, start: int, end: int) -> None:
    step(cache, 9, seed=1)
    reference = CACHES["contiguous"]()
    step(reference, 9, seed=1, like=cache)
    cache.remove_range(start, end, shift_marker)  # every cache here moves positions (lossy storage: tests/unit)
    cache.check_invariants()
    reference.remove_range(start, end, shift_marker)
    assert cache.seq_len == reference.seq_len == 9 - (end - start) and cache.positions_removed == end - start
    for got, want in zip(step(cache, 2, seed=4), step(reference, 2, seed=4, like=cache)):
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
        # One store: the moved keys are the values, turned with them (latent attention reads only
        # the channels RoPE leaves alone as its value).
        torch.testing.assert_close(got[1], want[0] if cache.spec.values_are_keys else want[1], rtol=0, atol=0)
    with pytest.raises(ValueError, match="cannot remove positions"):
        cache.remove_range(5, 20, shift_marker)
    cache.check_invariants()


def test_copy_prefix_gives_the_first_positions_and_leaves_the_source_alone(cache: KVCache) -> None:
    step(cache, 7, seed=1)
    target = cache.fork()
    target.reset()
    step(target, 3, seed=9)  # something to overwrite
    target.copy_prefix(cache, 5)
    assert target.seq_len == 5 and cache.seq_len == 7
    reference = CACHES["contiguous"]()
    step(reference, 7, seed=1, like=cache)
    reference.truncate(5)
    for got, want in zip(step(target, 2, seed=3), step(reference, 2, seed=3, like=cache)):
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
    with pytest.raises(ValueError, match="cannot copy 8 positions: the source holds 7"):
        target.copy_prefix(cache, 8)
    with pytest.raises(ValueError, match="two different caches"):
        cache.copy_prefix(cache, 2)
    with pytest.raises(ValueError, match="same kind and shape"):
        target.copy_prefix(ContiguousCache(CacheSpec(1, 1, 2), 4), 0)
    assert target.seq_len == 7
    cache.check_invariants()
    target.check_invariants()


def test_can_resume_is_true_for_every_held_prefix_when_nothing_was_dropped(cache: KVCache) -> None:
    step(cache, 6, seed=1)
    assert [cache.can_resume(n) for n in (-1, 0, 3, 6, 7)] == [False, True, True, True, False]
