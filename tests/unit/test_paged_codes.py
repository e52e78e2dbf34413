"""The engine's pool of K/V codes (kv/paged_codes.py): every sequence reads exactly what a
single-sequence QuantizedCache with no residual window and the same block size reads, through
appends, truncations and copy-on-write forks; staging slots are accounted; the C kernel that attends
over the codes through block tables equals softmax attention over the decoded history."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvgen.kernels import load
from kvgen.kv.block_pool import BlockPool
from kvgen.kv.codecs import key_codec, value_codec
from kvgen.kv.interface import AttentionSpan, CacheSpec
from kvgen.kv.paged_codes import QuantizedPagedStorage
from kvgen.kv.paged_codes_batch import QuantizedPagedBatchView
from kvgen.kv.paged_codes_cache import QuantizedPagedCache
from kvgen.kv.quantized import QuantizedCache
from kvgen.models.batch import build_batch_mask

SPEC = CacheSpec(num_layers=2, num_kv_heads=2, head_dim=32)
PAIRS = [("int8", "int8"), ("int4", "int4"), ("fp8", "fp16"), ("bf16", "int4")]
# int8 keys and values are read as integers (the query rounded to int16 codes, each tile's value
# weights to 15 bits), as the single-sequence cache reads them: up to ~1e-4 on these inputs
# (tests/unit/test_quantized_kv_attention.py); every other pair is decoded to floats.
INTEGER_TOLERANCE = 2e-4


def storage(k: str, v: str, num_blocks: int = 40, block_size: int = 4, num_slots: int = 12) -> QuantizedPagedStorage:
    return QuantizedPagedStorage(SPEC, BlockPool(num_blocks, block_size), key_codec(k), value_codec(v), num_slots)


def reference(k: str, v: str, block_size: int = 4) -> QuantizedCache:
    return QuantizedCache(SPEC, 8, 256, k, v, residual=0, block_tokens=block_size)


def append(caches: list, length: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same new keys/values into every cache (every layer), then commit; what each returned."""
    generator = torch.Generator().manual_seed(seed)
    returned: list[list] = [[] for _ in caches]
    for layer in range(SPEC.num_layers):
        keys = torch.randn(1, SPEC.num_kv_heads, length, SPEC.head_dim, generator=generator) * 3
        values = torch.randn(1, SPEC.num_kv_heads, length, SPEC.head_dim, generator=generator)
        for out, cache in zip(returned, caches):
            got_keys, got_values = cache.update(layer, keys, values)  # views valid until the next update
            out.append((got_keys.clone(), got_values.clone()))
    for cache in caches:
        cache.commit(length)
    return [(torch.cat([k for k, _ in out]), torch.cat([v for _, v in out])) for out in returned]


@pytest.mark.parametrize("k,v", PAIRS)
def test_reads_equal_the_single_sequence_cache_across_chunks_and_truncation(k: str, v: str) -> None:
    store = storage(k, v)
    paged, single = QuantizedPagedCache(store), reference(k, v)
    for seed, length in enumerate([5, 11, 4, 1, 1, 9, 1, 3]):
        got, want = append([paged, single], length, seed)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        paged.check_invariants()
        store.check_invariants()
    paged.truncate(14)  # into an encoded block: it is decoded into a slot when written again
    single.truncate(14)
    for seed, length in enumerate([3, 6]):
        got, want = append([paged, single], length, 100 + seed)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    paged.release()
    store.check_invariants()
    assert store.num_free_slots == store.num_slots and store.pool.num_free == store.pool.num_blocks


def test_full_blocks_hold_codes_and_only_the_unfilled_block_is_staged() -> None:
    store = storage("int8", "int4", block_size=4)
    cache = QuantizedPagedCache(store)
    append([cache], 10, seed=0)  # blocks 0, 1 full; block 2 holds 2 positions
    assert [store.is_staged(b) for b in cache.blocks] == [False, False, True]
    assert store.num_free_slots == store.num_slots - 1
    append([cache], 2, seed=1)  # block 2 fills: encoded at commit, its slot given back
    assert not any(store.is_staged(b) for b in cache.blocks) and store.num_free_slots == store.num_slots
    bytes_per_block = store.bytes_per_block()
    assert bytes_per_block < SPEC.bytes_per_token * 4 / 3  # int8 keys + int4 values: under a third of fp32


def test_out_of_slots_refuses_the_write_and_changes_nothing() -> None:
    store = storage("int8", "int8", num_slots=1)
    first, second = QuantizedPagedCache(store), QuantizedPagedCache(store)
    append([first], 2, seed=0)  # takes the only slot
    free_blocks = store.pool.num_free
    assert not second.prepare_write(0, 3)
    assert second.blocks == [] and store.pool.num_free == free_blocks and store.num_free_slots == 0
    first.release()
    assert second.prepare_write(0, 3)


class PagedCodesVersusSingleSequence(RuleBasedStateMachine):
    """Random appends, truncations and forks: every sequence over the pool of codes returns what a
    QuantizedCache (no residual window, the same block size) given the same operations returns."""

    def __init__(self) -> None:
        super().__init__()
        self.store = storage("int4", "int8", num_blocks=60, num_slots=12)
        self.pairs = [(QuantizedPagedCache(self.store), reference("int4", "int8"))]
        self.seed = 0

    @rule(index=st.integers(0, 10), length=st.integers(1, 7))
    def append(self, index: int, length: int) -> None:
        paged, single = self.pairs[index % len(self.pairs)]
        if single.seq_len + length > 40:
            return
        self.seed += 1
        got, want = append([paged, single], length, self.seed)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)

    @rule(index=st.integers(0, 10), keep=st.integers(0, 40))
    def truncate(self, index: int, keep: int) -> None:
        paged, single = self.pairs[index % len(self.pairs)]
        keep = min(keep, single.seq_len)
        paged.truncate(keep)
        single.truncate(keep)

    @precondition(lambda self: len(self.pairs) < 4)
    @rule(index=st.integers(0, 10))
    def fork(self, index: int) -> None:
        paged, single = self.pairs[index % len(self.pairs)]
        self.pairs.append((paged.fork(), single.fork()))

    @invariant()
    def consistent(self) -> None:
        self.store.pool.check_invariants()
        self.store.check_invariants()
        assert sum(b.ref_count for b in self.store.pool.blocks) == sum(len(p.blocks) for p, _ in self.pairs)
        for paged, single in self.pairs:
            paged.check_invariants()
            assert paged.seq_len == single.seq_len


TestPagedCodesVersusSingleSequence = PagedCodesVersusSingleSequence.TestCase
TestPagedCodesVersusSingleSequence.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)


@pytest.mark.skipif(load() is None, reason="the kernel needs a C compiler")
@pytest.mark.parametrize("k,v", PAIRS)
@pytest.mark.parametrize("window", [None, 6])
def test_kernel_attends_over_codes_as_softmax_over_the_decoded_history(k: str, v: str, window: int | None) -> None:
    """Ragged rows (a decode at 613 positions, a 5-token verify inside a block, a chunk across
    blocks, a fresh prompt, a 20-token chunk: two chunks of queries): the in-place kernel equals
    SDPA over what `update` returns, causal and windowed (a key or value row read from the wrong
    place would move the output by ~0.1-1)."""
    torch.manual_seed(0)
    store = storage(k, v, num_blocks=400, block_size=4)
    caches = [QuantizedPagedCache(store) for _ in range(5)]
    for cache, history in zip(caches, [613, 254, 9, 0, 300]):
        if history:
            append([cache], history, seed=history)
    lengths = [1, 5, 7, 5, 20]
    heads, dim, rows = 4, SPEC.head_dim, len(caches)
    q = torch.randn(rows, heads, max(lengths), dim)
    new_k = torch.randn(rows, SPEC.num_kv_heads, max(lengths), dim) * 2
    new_v = torch.randn(rows, SPEC.num_kv_heads, max(lengths), dim)
    starts = [c.seq_len for c in caches]
    forks = [c.fork() for c in caches]  # the reference runs on twins sharing the same blocks
    spans = tuple(AttentionSpan(window) for _ in caches)
    reference_view = QuantizedPagedBatchView(forks, lengths)
    keys, values = reference_view.update(1, new_k, new_v)
    mask = build_batch_mask(starts, lengths, [0] * rows, list(spans))
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=1 / math.sqrt(dim), enable_gqa=True
    )  # fmt: skip
    view = QuantizedPagedBatchView(caches, lengths)
    windows = view.in_place_starts(lengths, spans)
    assert windows is not None
    got = view.attend_in_place(1, q, new_k, new_v, 1 / math.sqrt(dim), windows)
    tolerance = INTEGER_TOLERANCE if (k, v) == ("int8", "int8") else 1e-5
    for row, n in enumerate(lengths):
        torch.testing.assert_close(got[row, :, :n], expected[row, :, :n], rtol=1e-5, atol=tolerance)
