"""WindowedCache: what sliding-window layers keep, and Gemma 3 past its 512-token window."""

from __future__ import annotations

import pytest
import torch

from kvgen import LLM, CacheConfig, SamplingParams
from kvgen.kv import CacheSpec, ContiguousCache
from kvgen.kv.window import WindowedCache
from tests.support.models import model_path
from tests.support.shakespeare import play_text

SPEC = CacheSpec(num_layers=2, num_kv_heads=1, head_dim=2)


def append(cache: WindowedCache, start: int, length: int) -> None:
    keys = torch.arange(start, start + length, dtype=torch.float32)[None, None, :, None].expand(1, 1, length, 2)
    for layer in range(SPEC.num_layers):
        cache.update(layer, keys, -keys)
    cache.commit(length)


def test_window_layers_drop_dead_positions_in_amortized_steps() -> None:
    cache = WindowedCache(SPEC, [None, 4], capacity=4)  # layer 0 full, layer 1 window 4
    append(cache, 0, 7)
    assert cache.visible_start(1) == 0  # fewer than 2 * window held: nothing dropped yet
    append(cache, 7, 1)  # 8 held = 2 * window: keep the last 3
    assert cache.visible_start(1) == 5 and cache.visible_start(0) == 0
    keys, _ = cache.update(1, torch.full((1, 1, 1, 2), 8.0), torch.zeros(1, 1, 1, 2))
    assert keys[0, 0, :, 0].tolist() == [5.0, 6.0, 7.0, 8.0]  # exactly what position 8 may see
    cache.check_invariants()


def test_rewind_is_refused_once_needed_positions_were_dropped() -> None:
    cache = WindowedCache(SPEC, [None, 4], capacity=4)
    append(cache, 0, 10)  # 8 held at commit: layer 1 keeps the last 3, so it starts at position 7
    assert cache.visible_start(1) == 7
    assert cache.can_truncate(10) and not cache.can_truncate(9)  # a query at 9 needs position 6
    with pytest.raises(ValueError, match="positions before 7 were dropped; recompute"):
        cache.truncate(9)
    cache.reset()  # emptying is always allowed, dropped positions or not
    assert cache.seq_len == 0 and cache.visible_start(1) == 0
    append(cache, 0, 3)
    cache.check_invariants()


@pytest.mark.parametrize("weights", ["fp32", "q4"])
def test_gemma3_past_the_window_equals_the_full_cache(weights: str) -> None:
    path = model_path("gemma3-270m")
    full = LLM.load(path, progress=False, weights=weights)
    windowed = LLM.load(path, progress=False, weights=weights, cache=CacheConfig("window"))
    ids = full.tokenizer.encode(play_text("hamlet"))[:1100]  # past 2 x 512: old positions are dropped
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    assert windowed.generate(ids, params).token_ids == full.generate(ids, params).token_ids
    with torch.inference_mode():
        cache = WindowedCache.for_model(full.config, torch.float32, 64)
        full.model(torch.tensor([ids]), cache)
    contiguous = ContiguousCache(CacheSpec.for_model(full.config), len(ids))
    # 15 sliding layers hold 2 x 512 slots, the 3 global layers all 1100 positions.
    assert cache.memory_bytes() == (15 * 1024 + 3 * 1100) * full.config.head_dim * 4 * 2
    assert cache.memory_bytes() < contiguous.memory_bytes()  # 94% here; ~27% of it at 8k tokens


@pytest.mark.slow
def test_gemma3_window_cache_matches_transformers_past_the_window() -> None:
    from tests.conftest import load_reference
    from tests.parity.test_gguf_parity import LOGIT_TOLERANCE

    model, tokenizer = load_reference("gemma3-270m")
    llm = LLM.load(model_path("gemma3-270m"), progress=False, weights="fp32", cache=CacheConfig("window"))
    ids = tokenizer(play_text("hamlet")).input_ids[:1100]
    with torch.inference_mode():
        expected = model(torch.tensor([ids])).logits[0, -1]
        cache = llm.generator.new_cache(len(ids))
        actual = llm.model(torch.tensor([ids[:-40]]), cache)  # prefill, then 40 single steps past 2 x 512
        for token in ids[-40:]:
            actual = llm.model(torch.tensor([[token]]), cache)
    assert (actual[0, -1] - expected).abs().max().item() < LOGIT_TOLERANCE
