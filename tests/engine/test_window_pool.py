"""The engine on Gemma 3 (five sliding-window layers of 512 per global one) with its pool split into
layer groups: prompts longer than the window, batched, chunked, preempted, resumed from the prefix
cache or verified speculatively, give exactly the tokens of the single-sequence window cache, while
each sequence holds only a window of pages for its local layers."""

from __future__ import annotations

import pytest
import torch

from kvgen import CacheConfig, SamplingParams
from kvgen.engine import EngineConfig, LLMEngine, RequestStatus
from kvgen.kv.paged_hybrid import HybridPagedCache
from kvgen.speculative.config import SpeculativeConfig
from tests.support.shakespeare import play_text

PARAMS = SamplingParams(max_new_tokens=8)
WINDOW = 512


@pytest.fixture(scope="module")
def long_ids(gemma3) -> list[int]:
    """~700 tokens of Hamlet: longer than the sliding window."""
    return gemma3.tokenizer.encode(play_text("hamlet"))[:700]


def window_cache_tokens(llm, ids: list[int], params: SamplingParams = PARAMS) -> list[int]:
    """Greedy tokens of the single-sequence window cache (kv/window.py)."""
    saved = llm.generator.cache_config
    llm.generator.cache_config = CacheConfig("window")
    try:
        return llm.generate(ids, params).token_ids
    finally:
        llm.generator.cache_config = saved


def drain(engine: LLMEngine, requests) -> None:
    while any(r.status is not RequestStatus.FINISHED for r in requests):
        engine.step()
        engine.check_invariants()


def pages_for(engine: LLMEngine, start: int, end: int) -> int:
    """Pages one sequence holds on the grouped pool after a forward over positions start..end-1:
    every block of the global layers, and per local group the blocks a query at `start` sees."""
    groups, size = engine.storage.groups, engine.storage.block_size
    anchor = -(-end // size)
    return anchor + sum(anchor - groups.first_block_needed(g, start, size) for g in range(1, groups.num_groups))


@torch.inference_mode()
def test_long_prompts_batched_and_chunked_equal_the_window_cache(gemma3, long_ids) -> None:
    engine = LLMEngine(gemma3, EngineConfig(num_blocks=600, max_tokens_per_step=256))
    assert engine.storage.groups.num_groups == 6 and engine.storage.groups.width == 3
    short = gemma3.tokenizer.encode("The quick brown fox")
    requests = [engine.add_request("long", long_ids, PARAMS), engine.add_request("short", short, PARAMS)]
    while requests[0].status is not RequestStatus.FINISHED:
        engine.step()
        engine.check_invariants()
        cache = requests[0].cache
        if cache is not None and cache.seq_len > len(long_ids) + 1:  # decoding, after the first decode
            assert isinstance(cache, HybridPagedCache)
            # Before each forward the pages no query from its start sees went back to the pool.
            assert len(cache.held_blocks()) == pages_for(engine, cache.seq_len - 1, cache.seq_len)
    drain(engine, requests)
    assert requests[0].output_ids == window_cache_tokens(gemma3, long_ids)
    assert requests[1].output_ids == window_cache_tokens(gemma3, short)
    engine.scheduler.prefix.clear()
    assert engine.storage.pool.num_free == engine.storage.pool.num_blocks


@torch.inference_mode()
def test_a_prefix_hit_beyond_the_window_is_exact(gemma3, long_ids) -> None:
    engine = LLMEngine(gemma3, EngineConfig(num_blocks=600, max_tokens_per_step=256))
    first = engine.add_request("first", long_ids, PARAMS)
    drain(engine, [first])
    follow_up = long_ids + first.output_ids + gemma3.tokenizer.encode(" And then")
    second = engine.add_request("second", follow_up, PARAMS)
    sibling = engine.add_request("sibling", long_ids[:600] + gemma3.tokenizer.encode(" Who is there?"), PARAMS)
    drain(engine, [second, sibling])
    assert second.miss_reason == "hit" and second.cached_tokens > WINDOW
    assert sibling.miss_reason == "hit" and WINDOW < sibling.cached_tokens <= 600  # pages indexed as blocks filled
    assert second.output_ids == window_cache_tokens(gemma3, follow_up)
    assert sibling.output_ids == window_cache_tokens(gemma3, long_ids[:600] + gemma3.tokenizer.encode(" Who is there?"))


@torch.inference_mode()
def test_a_small_pool_preempts_and_loses_nothing(gemma3, long_ids) -> None:
    params = SamplingParams(max_new_tokens=4)
    # Two 700-token prompts need 2 x 264 pages at the end of their prefill; 330 pages hold one.
    engine = LLMEngine(gemma3, EngineConfig(num_blocks=330, max_tokens_per_step=256, prefix_cache=False))
    prompts = [long_ids, long_ids[100:] + long_ids[:100]]
    requests = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    drain(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for request, prompt in zip(requests, prompts):
        assert request.output_ids == window_cache_tokens(gemma3, prompt, params)
    assert engine.storage.pool.num_free == engine.storage.pool.num_blocks


@torch.inference_mode()
def test_speculative_rewinds_stay_inside_the_window(gemma3, long_ids) -> None:
    engine = LLMEngine(gemma3, EngineConfig(num_blocks=600, max_tokens_per_step=256))
    params = SamplingParams(max_new_tokens=16)
    request = engine.add_request("spec", long_ids, params, speculative=SpeculativeConfig("lookup"))
    drain(engine, [request])
    assert request.output_ids == window_cache_tokens(gemma3, long_ids, params)


def test_the_disk_tier_keeps_every_layer_in_one_block(gemma3, tmp_path) -> None:
    engine = LLMEngine(gemma3, EngineConfig(num_blocks=64, kv_cache_dir=str(tmp_path)))
    try:
        assert engine.storage.groups.is_single
    finally:
        engine.close()


@torch.inference_mode()
def test_the_c_step_reads_each_layer_through_its_group(long_ids, monkeypatch) -> None:
    """With quantized weights one-token rows run kernels/decode.c over every layer: on the grouped
    pool each layer reads its own slot through its group's table, and the tokens equal the C step
    over a pool of one block per layer."""
    from kvgen import LLM
    from kvgen.models.fast_decode import FastDecoder
    from tests.support.models import model_path

    llm = LLM.load(model_path("gemma3-270m"), progress=False, weights="int8")
    steps = []
    original = FastDecoder.step_rows
    monkeypatch.setattr(FastDecoder, "step_rows", lambda self, *a: (steps.append(a[2][0]), original(self, *a))[1])
    prompts = [long_ids[:600], long_ids[600:640]]  # no shared prefix: both are admitted at once
    outputs = {}
    for grouped in (True, False):
        engine = LLMEngine(llm, EngineConfig(num_blocks=600, max_tokens_per_step=256, layer_groups=grouped))
        requests = [engine.add_request(f"r{i}", p, PARAMS) for i, p in enumerate(prompts)]
        steps.clear()
        drain(engine, requests)
        outputs[grouped] = [r.output_ids for r in requests]
        assert steps.count("kvgen_decode_rows") >= PARAMS.max_new_tokens - 1  # the decodes ran in C
    assert outputs[True] == outputs[False]


@torch.inference_mode()
def test_a_request_the_grouped_pool_cannot_hold_is_refused_and_one_it_can_runs(gemma3, long_ids) -> None:
    """Admission counts every layer group's pages: a request whose global layers alone fit the
    pool, but not with its local groups' windows, is refused at once (it would wait forever), and
    a pool of exactly the bound runs one to the end, never holding more."""
    config = EngineConfig(num_blocks=100, max_tokens_per_step=64)
    engine = LLMEngine(gemma3, config)
    assert engine.storage.pool.blocks_for(len(long_ids) + PARAMS.max_new_tokens) <= 100  # the global layers fit
    with pytest.raises(ValueError, match="more KV blocks than the whole pool"):
        engine.add_request("too big", long_ids, PARAMS)
    assert not engine.requests and engine.storage.pool.num_free == 100
    bound = engine.storage.groups.most_blocks(len(long_ids) + PARAMS.max_new_tokens, 64, engine.storage.block_size)
    assert bound < engine.storage.groups.num_groups * engine.storage.pool.blocks_for(len(long_ids) + PARAMS.max_new_tokens)
    engine = LLMEngine(gemma3, EngineConfig(num_blocks=bound, max_tokens_per_step=64, prefix_cache=False))
    request = engine.add_request("fits", long_ids, PARAMS)
    most_held = 0
    while request.status is not RequestStatus.FINISHED:
        engine.step()
        most_held = max(most_held, bound - engine.storage.pool.num_free)
    assert request.output_ids == window_cache_tokens(gemma3, long_ids)
    assert 0 < most_held <= bound
