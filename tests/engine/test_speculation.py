"""Speculative decoding inside the engine, per request, on the real SmolLM2: drafts are verified in
the same batched forward as the other requests' rows; greedy output equals each request run alone
(plain, no speculation), with structured output and with preemption, for every method (the EAGLE
head on the default 4-bit weights it was trained on); rejected drafts give their blocks back; a
cancelled speculative request frees everything."""

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
    engine = LLMEngine(smollm2, EngineConfig(num_blocks=64, speculative_max_batch=8))  # they draft side by side
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


def chat_prompts(llm, questions: list[str]) -> list[str]:
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in questions]


QUESTIONS = ["Explain how a bicycle stays upright.", "Write a short poem about the sea.",
             "What should I pack for a weekend hike?"]  # fmt: skip


def test_eagle_in_the_engine_batched_with_plain_requests_equals_each_alone(smollm2_q4) -> None:
    """The head drafts from the features the batched forward hands back; on the default 4-bit
    weights the rows run the C rows step, each token computed as a lone decode would be."""
    params = SamplingParams(max_new_tokens=32)
    prompts = chat_prompts(smollm2_q4, QUESTIONS)
    engine = LLMEngine(smollm2_q4, EngineConfig(num_blocks=64, block_size=4, speculative_max_batch=8))
    requests = [engine.add_request(f"e{i}", p, params, speculative=SpeculativeConfig("eagle")) for i, p in enumerate(prompts)]
    requests.append(engine.add_request("plain", prompts[0], params))
    drain(engine, requests)
    for request, prompt in zip(requests, prompts + prompts[:1]):
        assert request.output_ids == alone(smollm2_q4, prompt, params), prompt
    stats = [r.speculation.stats for r in requests[:-1]]
    assert sum(s.accepted_tokens for s in stats) > 0 and sum(s.verify_steps for s in stats) > 0
    assert engine.speculative_totals.accepted_tokens == sum(s.accepted_tokens for s in stats)
    assert_nothing_leaked(engine)


def test_eagle_requests_preempted_by_a_small_pool_lose_nothing(smollm2_q4) -> None:
    """A preempted request recomputes its tokens as a prompt; the head's own cache keeps the reply's
    features, and the recompute's last row hands over the one it lacks."""
    params = SamplingParams(max_new_tokens=24)
    prompts = chat_prompts(smollm2_q4, QUESTIONS)
    engine = LLMEngine(smollm2_q4, EngineConfig(num_blocks=12, block_size=8, max_tokens_per_step=64, speculative_max_batch=8))
    requests = [engine.add_request(f"p{i}", p, params, speculative=SpeculativeConfig("eagle")) for i, p in enumerate(prompts)]
    drain(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for request, prompt in zip(requests, prompts):
        assert request.output_ids == alone(smollm2_q4, prompt, params), prompt
    assert sum(r.speculation.stats.accepted_tokens for r in requests) > 0
    assert_nothing_leaked(engine)


def test_eagle_trees_are_refused_in_the_engine_before_anything_is_queued(smollm2_q4) -> None:
    engine = LLMEngine(smollm2_q4, EngineConfig(num_blocks=64))
    with pytest.raises(ValueError, match="the engine verifies chains: leave draft_alternatives unset or at 0"):
        engine.add_request("e", REPETITIVE[0], PARAMS, speculative=SpeculativeConfig("eagle", draft_alternatives=1))
    assert not engine.requests and engine.storage.pool.num_free == engine.storage.pool.num_blocks


def test_cancelling_an_eagle_request_frees_everything(smollm2_q4) -> None:
    engine = LLMEngine(smollm2_q4, EngineConfig(num_blocks=64, prefix_cache=False))
    prompt = chat_prompts(smollm2_q4, QUESTIONS[:1])[0]
    request = engine.add_request("c", prompt, SamplingParams(max_new_tokens=50), speculative=SpeculativeConfig("eagle"))
    for _ in range(6):
        engine.step()
    assert request.speculation.stats.verify_steps > 0
    assert engine.cancel("c").finish_reason == "cancelled"
    assert_nothing_leaked(engine)


def test_costly_drafts_wait_for_a_small_batch_while_lookup_always_drafts(smollm2_q4) -> None:
    """By default an EAGLE request drafts only while it decodes alone (its head runs one request at
    a time before the batched forward); beside another it decodes plainly, still taking the
    features its next drafts start from. Lookup drafts for free and drafts in any batch."""
    params = SamplingParams(max_new_tokens=24)
    prompts = chat_prompts(smollm2_q4, QUESTIONS[:2])
    engine = LLMEngine(smollm2_q4, EngineConfig(num_blocks=64))
    eagle = engine.add_request("eagle", prompts[0], params, speculative=SpeculativeConfig("eagle"))
    longer = SamplingParams(max_new_tokens=200, ignore_eos=True)  # decodes as long as the EAGLE request does
    lookup = engine.add_request("lookup", REPETITIVE[1], longer, speculative=LOOKUP)
    drain(engine, [eagle, lookup])
    assert eagle.speculation.stats.verify_steps == 0 and eagle.speculation.stats.plain_steps > 0
    assert lookup.speculation.stats.accepted_tokens > 0
    assert eagle.output_ids == alone(smollm2_q4, prompts[0], params)
    alone_engine = LLMEngine(smollm2_q4, EngineConfig(num_blocks=64))  # alone, the same request drafts
    again = alone_engine.add_request("eagle", prompts[0], params, speculative=SpeculativeConfig("eagle"))
    drain(alone_engine, [again])
    assert again.speculation.stats.verify_steps > 0 and again.output_ids == eagle.output_ids
    with pytest.raises(ValueError, match="speculative_max_batch must be an integer >= 0, got -1"):
        EngineConfig(speculative_max_batch=-1)
