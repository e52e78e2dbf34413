"""The layer-skip self-draft shares the target's cache on the real 4-bit SmolLM2 (the C decode path):
its keys and values for the first layers are the target's bit for bit, it drafts one token per step
in the target's cache (never a prefill or a catch-up), and greedy output equals plain decoding's (a
draft position left in the cache would shift every later verify and break that, and the proposer
asserts the cache length at each call)."""

from __future__ import annotations

import pytest
import torch

from kvgen import LLM, CacheConfig, SamplingParams, SpeculativeConfig
from kvgen.generate import Generator
from kvgen.kv.contiguous import ContiguousCache
from kvgen.kv.interface import CacheSpec

# Not adaptive: the draft runs at every step whatever the machine's load does to the step timings.
DRAFT_EVERY_STEP = SpeculativeConfig("self", draft_layers=24, num_draft_tokens=3, min_draft_tokens=3, adaptive=False)
PROMPT = "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox"


def first_layers_kv(cache: ContiguousCache, layers: int, position: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    return cache._keys[:layers, 0, :, position : position + count].clone(), cache._values[:layers, 0, :, position : position + count].clone()


def test_draft_steps_write_the_targets_first_layer_keys_and_values_bit_for_bit(smollm2_q4: LLM):
    model = smollm2_q4.model
    layers = model.config.num_layers // 2
    ids = smollm2_q4.tokenizer.encode(PROMPT)
    start, drafts = len(ids) - 1, [1000, 2000]
    cache = ContiguousCache(CacheSpec.for_model(model.config), 128)
    with torch.inference_mode():
        model(torch.tensor([ids[:-1]]), cache)
        model(torch.tensor([[ids[-1]]]), cache)  # a plain decode step over every layer
        plain = first_layers_kv(cache, layers, start, 1)
        cache.truncate(start)
        model(torch.tensor([[ids[-1], *drafts]]), cache, logits_to_keep=None)  # a verify: kernel rows
        verified = first_layers_kv(cache, layers, start, 3)
        cache.truncate(start)
        for token in [ids[-1], *drafts]:  # the draft: one-token steps over the first layers only
            model.hidden_states(torch.tensor([[token]]), cache, layers)
        drafted = first_layers_kv(cache, layers, start, 3)
    for got, want in zip(drafted, verified):
        assert torch.equal(got, want)
    for got, want in zip(plain, verified):
        assert torch.equal(got, want[:, :, :1])


@pytest.mark.parametrize("cache_kind", ["contiguous", "paged"])
def test_self_draft_drafts_one_token_at_a_time_in_the_targets_cache(smollm2_q4: LLM, monkeypatch, cache_kind):
    params = SamplingParams(max_new_tokens=24)
    plain = smollm2_q4.generate(PROMPT, params)
    model, calls = smollm2_q4.model, []
    hidden_states = model.hidden_states

    def recorded(input_ids, cache, num_layers=None):
        calls.append((input_ids.shape[1], cache))
        return hidden_states(input_ids, cache, num_layers)

    monkeypatch.setattr(model, "hidden_states", recorded)
    cache = CacheConfig() if cache_kind == "contiguous" else CacheConfig(kind="paged", block_size=4, budget_mb=16)
    generator = Generator(model, smollm2_q4.tokenizer, cache=cache)
    stream = generator.stream(PROMPT, params, speculative=DRAFT_EVERY_STEP)
    token_ids = [chunk.token_id for chunk in stream]
    assert token_ids == plain.token_ids
    stats = stream.result.speculative
    assert stats.accepted_tokens > 0
    assert stream._proposer.own is None  # no cache of its own, so no prefill and no catch-up
    assert calls and all(length == 1 and cache is stream.cache for length, cache in calls)
    assert len(calls) == stats.proposed_tokens  # one step in the target's cache per drafted token
