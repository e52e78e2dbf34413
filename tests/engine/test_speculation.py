"""Speculative decoding inside the engine, per request, on the real SmolLM2: drafts are verified in
the same batched forward as the other requests' rows; greedy output equals each request run alone
(plain, no speculation), with structured output and with preemption; rejected drafts give their
blocks back; a cancelled speculative request frees everything."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvgen import SamplingParams, SpeculativeConfig, StructuredOutput
from kvgen.engine import EngineConfig, LLMEngine
from tests.engine.test_engine import alone, assert_nothing_leaked, drain

REPETITIVE = [
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "Colors: red, green, blue, red, green, blue, red, green,",
    "Once upon a time, there was a little girl who",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11,",
]
PARAMS = SamplingParams(max_new_tokens=16)
LOOKUP = SpeculativeConfig("lookup")


def test_speculative_and_plain_requests_batched_together_equal_each_alone(smollm2) -> None:
    engine = LLMEngine(smollm2, EngineConfig(num_blocks=64, block_size=4))  # small blocks: rollbacks free blocks
    requests = [engine.add_request(f"s{i}", p, PARAMS, speculative=LOOKUP) for i, p in enumerate(REPETITIVE)]
    requests.append(engine.add_request("plain", REPETITIVE[0], PARAMS))
    drain(engine, requests)
    for request, prompt in zip(requests, REPETITIVE + REPETITIVE[:1]):
        assert request.output_ids == alone(smollm2, prompt, PARAMS), prompt
        assert request.usage().completion_tokens == len(request.output_ids)
    stats = [r.speculation.stats for r in requests[:-1]]
    assert sum(s.accepted_tokens for s in stats) > 0  # some forwards gave a row several tokens
    assert_nothing_leaked(engine)


@pytest.mark.parametrize("method", ["self", "draft"])
def test_model_drafters_in_the_engine_equal_greedy(smollm2, smollm2_q4, method) -> None:
    config = SpeculativeConfig("draft", draft_model=smollm2_q4) if method == "draft" else SpeculativeConfig("self", draft_layers=24)
    engine = LLMEngine(smollm2, EngineConfig(num_blocks=64))
    requests = [engine.add_request(f"m{i}", p, PARAMS, speculative=config) for i, p in enumerate(REPETITIVE[:2])]
    drain(engine, requests)
    for request, prompt in zip(requests, REPETITIVE):
        assert request.output_ids == alone(smollm2, prompt, PARAMS), prompt
    assert sum(r.speculation.stats.proposed_tokens for r in requests) > 0
    assert_nothing_leaked(engine)


def test_speculative_json_schema_requests_validate_and_equal_plain(smollm2) -> None:
    schema = {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
              "minItems": 4, "maxItems": 6}}, "required": ["colors"], "additionalProperties": False}  # fmt: skip
    params = SamplingParams(max_new_tokens=40, structured=StructuredOutput.json_schema(schema))
    prompt = 'Colors: red, green, blue, red, green, blue. As JSON {"colors": [...]}:'
    engine = LLMEngine(smollm2, EngineConfig(num_blocks=64))
    spec = engine.add_request("json-spec", prompt, params, speculative=LOOKUP)
    plain = engine.add_request("json-plain", prompt, params)
    drain(engine, [spec, plain])
    assert spec.output_ids == plain.output_ids == alone(smollm2, prompt, params)
    jsonschema.validate(json.loads(smollm2.tokenizer.decode(spec.output_ids)), schema)
    assert spec.speculation.stats.accepted_tokens > 0
    assert_nothing_leaked(engine)


def test_a_small_pool_preempts_speculative_requests_and_loses_nothing(smollm2) -> None:
    params = SamplingParams(max_new_tokens=20)
    engine = LLMEngine(smollm2, EngineConfig(num_blocks=8, block_size=8, max_tokens_per_step=64))  # 64 slots
    requests = [engine.add_request(f"p{i}", p, params, speculative=LOOKUP) for i, p in enumerate(REPETITIVE)]
    drain(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for request, prompt in zip(requests, REPETITIVE):
        assert request.output_ids == alone(smollm2, prompt, params), prompt
    assert_nothing_leaked(engine)


def test_cancelling_a_speculative_request_frees_its_blocks_and_draft_cache(smollm2) -> None:
    engine = LLMEngine(smollm2, EngineConfig(num_blocks=64, prefix_cache=False))
    request = engine.add_request("c", REPETITIVE[0], SamplingParams(max_new_tokens=50),
                                 speculative=SpeculativeConfig("self", draft_layers=8))  # fmt: skip
    for _ in range(4):
        engine.step()
    drafter_cache = request.speculation.proposer.own.cache  # in the engine the self-draft keeps its own cache
    assert drafter_cache.seq_len > 0
    assert engine.cancel("c").finish_reason == "cancelled"
    assert drafter_cache.seq_len == 0  # the self-draft's own cache was released
    assert_nothing_leaked(engine)


def test_eagle_is_refused_in_the_engine_before_anything_is_queued(smollm2) -> None:
    engine = LLMEngine(smollm2, EngineConfig(num_blocks=64))
    with pytest.raises(ValueError, match="not available in the engine"):
        engine.add_request("e", REPETITIVE[0], PARAMS, speculative=SpeculativeConfig("eagle"))
    assert not engine.requests and engine.storage.pool.num_free == engine.storage.pool.num_blocks
