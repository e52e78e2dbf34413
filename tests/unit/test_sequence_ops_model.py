"""Multi-sequence operations and window policies on the real SmolLM2 (fp32): copy-prefix and
chunked attention equal recomputing from scratch, remove-range on paged equals contiguous, and
attention sinks generate exactly like the full cache until their first eviction."""

from __future__ import annotations

import pytest
import torch

from kvgen import CacheConfig, SamplingParams
from kvgen.generate import Generator
from kvgen.kv import CacheSpec, ContiguousCache, KVCache, PagedCache, PagedStorage
from kvgen.kv.window import WindowedCache

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs into the forest to find its friends"


def fresh_logits(model, ids: list[int], positions: torch.Tensor | None = None) -> torch.Tensor:
    cache = ContiguousCache(CacheSpec.for_model(model.config), 128)
    return model(torch.tensor([ids]), cache, positions=positions)[0, -1]


@pytest.mark.parametrize("kind", ["contiguous", "paged"])
def test_copy_prefix_then_continue_equals_recomputing(smollm2, kind: str) -> None:
    model, spec = smollm2.model, CacheSpec.for_model(smollm2.config)
    ids = smollm2.tokenizer.encode(TEXT)
    store = PagedStorage.create(spec, budget_mb=16, block_size=16)

    def new() -> KVCache:
        return PagedCache(store) if kind == "paged" else ContiguousCache(spec, 64)

    with torch.inference_mode():
        source, target = new(), new()
        model(torch.tensor([ids]), source)
        model(torch.tensor([[42, 43, 44]]), target)  # contents the copy must replace
        keep = 17  # one whole block of 16 shared, the 17th position copied
        target.copy_prefix(source, keep)
        if isinstance(target, PagedCache):  # the whole block is shared, the partial one is a copy
            assert target.blocks[0] is source.blocks[0] and target.blocks[1] is not source.blocks[1]
        continued = [model(torch.tensor([ids[keep:]]), target)[0, -1]]
        tokens = list(ids)
        for _ in range(4):  # greedy steps past the copy
            tokens.append(int(continued[-1].argmax()))
            continued.append(model(torch.tensor([tokens[-1:]]), target)[0, -1])
        assert source.seq_len == len(ids)  # the source is untouched
        for step, logits in enumerate(continued):
            torch.testing.assert_close(logits, fresh_logits(model, tokens[: len(ids) + step]), rtol=0, atol=1e-4)
    if kind == "paged":
        source.release()
        target.release()
        assert store.pool.num_free == store.pool.num_blocks
        store.pool.check_invariants()


def test_paged_remove_range_equals_contiguous_remove_range(smollm2) -> None:
    model, spec = smollm2.model, CacheSpec.for_model(smollm2.config)
    ids = smollm2.tokenizer.encode(TEXT)
    store = PagedStorage.create(spec, budget_mb=16, block_size=8)
    with torch.inference_mode():
        paged, plain = PagedCache(store), ContiguousCache(spec, 64)
        for cache in (paged, plain):
            model(torch.tensor([ids]), cache)
            cache.remove_range(3, 12, model.rerotate)  # crosses block boundaries
        a = model(torch.tensor([[1010, 2020]]), paged, logits_to_keep=2)[0]
        b = model(torch.tensor([[1010, 2020]]), plain, logits_to_keep=2)[0]
        assert a.argmax(-1).tolist() == b.argmax(-1).tolist()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
        # Layer 0 depends on each token alone: after the move it equals a fresh prefill of the shorter text.
        shorter = ContiguousCache(spec, 64)
        model(torch.tensor([ids[:3] + ids[12:]]), shorter)
        n = shorter.seq_len
        keys = paged._gather(0, store.keys[0], n)
        torch.testing.assert_close(keys, shorter._keys[0, :, :, :n], rtol=0, atol=1e-4)
    paged.release()
    assert store.pool.num_free == store.pool.num_blocks


def test_chunked_attention_equals_recomputing_the_chunk(smollm2) -> None:
    """With every layer chunked, a token depends only on its chunk: the cache's logits equal a fresh
    forward of that chunk alone at the same positions."""
    model = smollm2.model
    ids = smollm2.tokenizer.encode(" ".join([TEXT] * 4))[:70]
    assert len(ids) == 70
    with torch.inference_mode():
        cache = WindowedCache.for_model(smollm2.config, torch.float32, 64, chunk=16)
        prefill = model(torch.tensor([ids[:60]]), cache)[0, -1]  # 3 whole chunks and 12 of the 4th
        steps = [model(torch.tensor([[t]]), cache)[0, -1] for t in ids[60:70]]  # decode across a chunk edge
        torch.testing.assert_close(prefill, fresh_logits(model, ids[48:60], torch.arange(48, 60)[None]), rtol=0, atol=1e-4)
        last = fresh_logits(model, ids[64:70], torch.arange(64, 70)[None])
        torch.testing.assert_close(steps[-1], last, rtol=0, atol=1e-4)
    assert cache.visible_start(0) >= 48 and cache.memory_bytes() < ContiguousCache(CacheSpec.for_model(smollm2.config), 70).memory_bytes()


def test_sinks_generate_like_the_full_cache_until_the_first_eviction_and_stay_bounded(smollm2) -> None:
    ids = smollm2.tokenizer.encode("Once upon a time, in a small village by the sea, there lived")
    params = SamplingParams(max_new_tokens=120, ignore_eos=True)
    full = Generator(smollm2.model, smollm2.tokenizer).generate(ids, params)
    sinks = Generator(smollm2.model, smollm2.tokenizer, cache=CacheConfig("sinks", window=40, sinks=4))
    stream = sinks.stream(ids, params)
    for _ in stream:
        assert stream.cache.seq_len <= 4 + 40 - 1
    untouched = 4 + 40 - 1 - len(ids)  # tokens generated before anything was evicted
    assert stream.result.token_ids[:untouched] == full.token_ids[:untouched]
    assert len(stream.result.token_ids) == 120 and stream.ids_in_cache() == []  # evicted: no prefix to reuse
