"""A prompt whose prefix another request is still computing waits for it to be indexed instead of
computing it a second time: a burst of one system prompt is prefilled once."""

from __future__ import annotations

from kvgen import SamplingParams
from kvgen.engine import EngineConfig, LLMEngine
from tests.support.shakespeare import play_text

PARAMS = SamplingParams(max_new_tokens=6)


def test_a_shared_prefix_in_flight_is_computed_once(smollm2) -> None:
    system = smollm2.tokenizer.encode(play_text("hamlet"))[:200]
    first, second = system + smollm2.tokenizer.encode(" Who speaks?"), system + smollm2.tokenizer.encode(" Where are we?")
    alone = [smollm2.generate(p, PARAMS).token_ids for p in (first, second)]
    # A step budget of 64 tokens: the first prompt takes 4 steps, and the second arrives after one.
    engine = LLMEngine(smollm2, EngineConfig(num_blocks=64, max_tokens_per_step=64))
    a = engine.add_request("a", first, PARAMS)
    engine.step()
    b = engine.add_request("b", second, PARAMS)
    computed = engine.runner.num_tokens
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
    assert b.cached_tokens == 192  # the 12 whole blocks of the shared 200 tokens (blocks of 16)
    # Tokens run after b arrived: the rest of a's prompt, b's own tail, and the decodes; nothing twice.
    rest_of_a, tail_of_b = len(first) - 64, len(second) - 192
    assert engine.runner.num_tokens - computed == rest_of_a + tail_of_b + 2 * (PARAMS.max_new_tokens - 1)
    assert [a.output_ids, b.output_ids] == alone


def test_only_the_same_tenant_waits(smollm2) -> None:
    """Tenants never share blocks, so one never waits for another's prefill; the same tenant does."""
    system = smollm2.tokenizer.encode(play_text("hamlet"))[:200]
    for salt, admitted in (("tenant-a", False), ("tenant-b", True)):
        # A step budget of 128: a's prompt needs two steps, leaving room for b in the second.
        engine = LLMEngine(smollm2, EngineConfig(num_blocks=64, max_tokens_per_step=128))
        engine.add_request("a", system + [1], PARAMS, salt="tenant-a")
        engine.step()
        b = engine.add_request("b", system + [2], PARAMS, salt=salt)
        engine.step()
        assert (b in engine.scheduler.running) == admitted, salt
        assert b.cached_tokens == 0
