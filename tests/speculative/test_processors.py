"""Speculation under the request's full sampling rules, on the real SmolLM2: a JSON schema (drafts
masked by the grammar, verification through the grammar), penalties, logit bias, min_new_tokens
and logprobs give plain decoding's tokens, text and logprobs. Peers refuse or crash on these
combinations; here the sampler's processors run position by position during verification."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvgen import SamplingParams, SpeculativeConfig, StructuredOutput
from tests.speculative.test_greedy_equality import speculative_config

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 3, "maxItems": 6},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "colors", "count"],
    "additionalProperties": False,
}
PROMPT = ('Describe the flag as JSON like {"name": "Tricolour", "colors": ["red", "green", "blue"], "count": 3}.\n'
          'The flag "Tricolour" has colors red, green, blue, red, green, blue. JSON:')  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lookup", "self", "draft", "eagle"])
def test_json_schema_speculation_equals_plain_structured_greedy(smollm2, smollm2_q4, method):
    params = SamplingParams(max_new_tokens=48, structured=StructuredOutput.json_schema(SCHEMA))
    plain = smollm2.generate(PROMPT, params)
    result = smollm2.generate(PROMPT, params, speculative=speculative_config(method, smollm2_q4))
    assert result.token_ids == plain.token_ids and result.text == plain.text
    assert result.finish_reason == plain.finish_reason
    jsonschema.validate(json.loads(result.text), SCHEMA)
    assert result.speculative.proposed_tokens > 0


def test_lookup_drafts_under_a_grammar_are_accepted_and_the_output_validates(smollm2):
    """The prompt quotes the answer: lookup drafts from it, the grammar keeps them valid, the
    target accepts most of them."""
    params = SamplingParams(max_new_tokens=48, structured=StructuredOutput.json_schema(SCHEMA))
    plain = smollm2.generate(PROMPT, params)
    result = smollm2.generate(PROMPT, params, speculative=SpeculativeConfig("lookup"))
    assert result.token_ids == plain.token_ids
    jsonschema.validate(json.loads(result.text), SCHEMA)
    assert result.speculative.accepted_tokens > 0


@pytest.mark.parametrize("method", ["lookup", "self"])
def test_penalties_bias_min_tokens_and_logprobs_match_plain_decoding(smollm2, method):
    banned = smollm2.tokenizer.encode(" the", add_special_tokens=False)[0]
    params = SamplingParams(max_new_tokens=24, repetition_penalty=1.05, frequency_penalty=0.05, presence_penalty=0.05,
                            logit_bias={banned: -100.0}, min_new_tokens=20, logprobs=True, top_logprobs=3)  # fmt: skip
    prompt = "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox"
    plain = smollm2.generate(prompt, params)
    result = smollm2.generate(prompt, params, speculative=speculative_config(method, None))
    assert result.token_ids == plain.token_ids and banned not in result.token_ids
    assert len(result.logprobs) == len(plain.logprobs) == len(result.token_ids)
    for mine, reference in zip(result.logprobs, plain.logprobs):
        assert mine.token_id == reference.token_id
        assert abs(mine.logprob - reference.logprob) < 1e-3  # a k+1-token forward vs one token: float order
        assert [t for t, _ in mine.top] == [t for t, _ in reference.top]
    assert result.speculative.proposed_tokens > 0


def test_seeded_sampling_with_a_grammar_and_speculation_always_validates(smollm2):
    """Sampling (rejection sampling path) under a grammar: every seed's output is valid JSON."""
    params = SamplingParams(max_new_tokens=48, temperature=0.8, structured=StructuredOutput.json_schema(SCHEMA))
    for seed in range(3):
        result = smollm2.generate(PROMPT, SamplingParams(**{**params.__dict__, "seed": seed}),
                                  speculative=SpeculativeConfig("lookup"))  # fmt: skip
        jsonschema.validate(json.loads(result.text), SCHEMA)
