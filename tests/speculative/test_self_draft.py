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


def test_a_draft_with_its_own_cache_prefills_and_catches_up_with_the_c_rows_step(smollm2_q4: LLM, monkeypatch):
    """A quantized target cache cannot be shared: the draft keeps its own first-layers cache. Its
    prompt prefill and catch-ups run the C rows step over those layers, not the torch forward."""
    params = SamplingParams(max_new_tokens=24)
    model, draft_layers = smollm2_q4.model, DRAFT_EVERY_STEP.draft_layers
    decoder, rows, torch_path = model.fast_decoder(), [], []
    step_tokens, hidden_states = decoder.step_tokens, model._hidden_states

    def rows_step(h, rope, cache, positions, slot=-1, num_layers=None):
        rows.append((h.shape[0], num_layers))
        return step_tokens(h, rope, cache, positions, slot, num_layers)

    def torch_forward(input_ids, cache, positions, num_layers):
        torch_path.append(num_layers)
        return hidden_states(input_ids, cache, positions, num_layers)

    monkeypatch.setattr(decoder, "step_tokens", rows_step)
    monkeypatch.setattr(model, "_hidden_states", torch_forward)
    cache = CacheConfig(kind="quantized", k_dtype="fp16", v_dtype="fp16", residual=0)
    generator = Generator(model, smollm2_q4.tokenizer, cache=cache)
    plain = generator.generate(PROMPT, params)
    rows.clear()
    stream = generator.stream(PROMPT, params, speculative=DRAFT_EVERY_STEP)
    assert [chunk.token_id for chunk in stream] == plain.token_ids
    assert stream._proposer.own is not None and stream.result.speculative.accepted_tokens > 0
    prompt_length = len(smollm2_q4.tokenizer.encode(PROMPT))
    assert (prompt_length + 1, draft_layers) in rows  # the prefill (the prompt and the first token)
    assert any(n == draft_layers and length < prompt_length for length, n in rows)  # catch-ups
    assert draft_layers not in torch_path
