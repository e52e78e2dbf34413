"""Greedy speculative decoding emits exactly plain greedy decoding's tokens, for every proposer and
every cache kind that can roll back, on the real SmolLM2 (fp32). The reference is the same model and
cache decoding one token per forward."""

from __future__ import annotations

import pytest

from kvgen import CacheConfig, SamplingParams, SpeculativeConfig
from kvgen.generate import Generator

PROMPTS = [
    "Once upon a time, there was a little girl who",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\ndef fibonacci_",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
]
CACHES = {
    "contiguous": CacheConfig(),
    "paged": CacheConfig(kind="paged", block_size=4, budget_mb=64),  # small blocks: rollbacks free blocks
    "window": CacheConfig(kind="window", window=16, extra=8),  # every layer narrowed to 16: drops positions
    "quantized": CacheConfig(kind="quantized", k_dtype="fp16", v_dtype="fp16", residual=0),
}
PARAMS = SamplingParams(max_new_tokens=20)
_reference: dict[tuple[str, str], list[int]] = {}


def plain_greedy(generator: Generator, cache_kind: str, prompt: str) -> list[int]:
    if (cache_kind, prompt) not in _reference:
        _reference[cache_kind, prompt] = generator.generate(prompt, PARAMS).token_ids
    return _reference[cache_kind, prompt]


def speculative_config(method: str, draft_llm) -> SpeculativeConfig:
    if method == "draft":
        return SpeculativeConfig("draft", draft_model=draft_llm)
    if method == "self":
        return SpeculativeConfig("self", draft_layers=24)
    return SpeculativeConfig(method)


@pytest.mark.slow
@pytest.mark.parametrize("cache_kind", list(CACHES))
@pytest.mark.parametrize("method", ["lookup", "self", "draft", "eagle"])
def test_greedy_speculative_equals_plain_greedy(smollm2, smollm2_q4, method, cache_kind):
    generator = Generator(smollm2.model, smollm2.tokenizer, cache=CACHES[cache_kind])
    config = speculative_config(method, smollm2_q4)
    proposed = 0
    for prompt in PROMPTS:
        result = generator.generate(prompt, PARAMS, speculative=config)
        assert result.token_ids == plain_greedy(generator, cache_kind, prompt), (method, cache_kind, prompt)
        proposed += result.speculative.proposed_tokens
    assert proposed > 0  # speculation really ran (drafts were verified), not only plain steps
    if cache_kind == "paged":
        assert generator.caches.paged_storage.pool.num_free == generator.caches.paged_storage.pool.num_blocks


def test_lookup_on_a_repetitive_prompt_accepts_drafts_and_matches_greedy(smollm2):
    prompt = PROMPTS[2]
    params = SamplingParams(max_new_tokens=12)
    plain = smollm2.generate(prompt, params)
    result = smollm2.generate(prompt, params, speculative=SpeculativeConfig("lookup"))
    assert result.token_ids == plain.token_ids
    assert result.speculative.accepted_tokens > 0
    assert result.text == plain.text
