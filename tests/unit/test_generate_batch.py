"""LLM.generate_batch: prompts of different lengths decoded in one batched forward per step give,
greedy, exactly the tokens and text each prompt gets alone; bad input changes nothing."""

from __future__ import annotations

import pytest

from kvgen import SamplingParams
from tests.support.models import PROMPTS

EIGHT_PROMPTS = PROMPTS + [
    "Hi",
    "The quick brown fox jumps over the lazy dog. " * 6 + "Then",
    "List three fruits:",
]


@pytest.mark.slow
def test_batched_greedy_equals_one_by_one(smollm2) -> None:
    params = SamplingParams(max_new_tokens=20)
    batched = smollm2.generate_batch(EIGHT_PROMPTS, params)
    assert len({len(smollm2.generator.encode_prompt(p)) for p in EIGHT_PROMPTS}) >= 6  # lengths really differ
    for prompt, result in zip(EIGHT_PROMPTS, batched):
        alone = smollm2.generate(prompt, params)
        assert result.token_ids == alone.token_ids, prompt
        assert result.text == alone.text
        assert result.finish_reason == alone.finish_reason
        assert result.usage.prompt_tokens == alone.usage.prompt_tokens
        assert result.usage.completion_tokens == len(alone.token_ids)


def test_per_prompt_params_and_stop_strings(smollm2) -> None:
    prompts = ["Once upon a time, there was a little girl who", "The three primary colors are"]
    params = [SamplingParams(max_new_tokens=12, stop=["her"]), SamplingParams(max_new_tokens=5)]
    batched = smollm2.generate_batch(prompts, params)
    for prompt, p, result in zip(prompts, params, batched):
        alone = smollm2.generate(prompt, p)
        assert (result.token_ids, result.text, result.finish_reason) == (alone.token_ids, alone.text, alone.finish_reason)
    assert "her" not in batched[0].text


def test_a_bad_prompt_rejects_the_batch_and_leaks_nothing(smollm2) -> None:
    smollm2.generate_batch(["warm up"], SamplingParams(max_new_tokens=2))
    engine = smollm2._batch.engine
    free_before = engine.storage.pool.num_free
    with pytest.raises(ValueError, match="empty"):
        smollm2.generate_batch(["a fine prompt", ""], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="one per prompt"):
        smollm2.generate_batch(["a", "b"], [SamplingParams()])
    engine.check_invariants()
    assert not engine.requests and engine.storage.pool.num_free == free_before
