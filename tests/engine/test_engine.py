"""LLMEngine on the real SmolLM2 / Gemma 3: continuous batching with chunked prefill gives exactly
the tokens of each request run alone (greedy); preemption, cancellation and failures lose nothing
and leak no block; the prefix cache reuses shared prompts and explains its misses."""

from __future__ import annotations

import pytest
import torch

from kvgen import SamplingParams
from kvgen.engine import EngineConfig, LLMEngine, RequestStatus
from kvgen.errors import PromptTooLongError
from tests.support.models import PROMPTS

PARAMS = SamplingParams(max_new_tokens=8)
SYSTEM = "You are a careful assistant. Answer in one short sentence, plainly, and never make up facts. " * 3


def alone(llm, prompt, params=PARAMS) -> list[int]:
    return llm.generate(prompt, params).token_ids


def drain(engine: LLMEngine, requests) -> None:
    while any(r.status is not RequestStatus.FINISHED for r in requests):
        engine.step()
        engine.check_invariants()


def assert_nothing_leaked(engine: LLMEngine) -> None:
    """After every request: only prefix-index blocks are held; clearing the index frees the pool."""
    engine.check_invariants()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    if engine.scheduler.prefix is not None:
        engine.scheduler.prefix.clear()
    assert engine.storage.pool.num_free == engine.storage.pool.num_blocks


def test_batched_requests_equal_each_request_alone(smollm2) -> None:
    engine = LLMEngine(smollm2, EngineConfig(num_blocks=64, max_tokens_per_step=12))  # prompts arrive in chunks
    requests = [engine.add_request(f"r{i}", p, PARAMS) for i, p in enumerate(PROMPTS)]
    drain(engine, requests)
    for request, prompt in zip(requests, PROMPTS):
        assert request.output_ids == alone(smollm2, prompt), prompt
        assert request.usage().completion_tokens == len(request.output_ids)
    assert requests[-1].finish_reason == "stop" and requests[0].finish_reason == "length"
    assert engine.runner.num_forwards < sum(len(r.output_ids) for r in requests)  # rows really shared forwards
    assert_nothing_leaked(engine)


def test_requests_arriving_while_others_decode(smollm2) -> None:
    engine = LLMEngine(smollm2, EngineConfig(num_blocks=64))
    first = engine.add_request("first", PROMPTS[0], PARAMS)
    engine.step()
    engine.step()
    later = engine.add_request("later", PROMPTS[1], PARAMS)
    drain(engine, [first, later])
    assert first.output_ids == alone(smollm2, PROMPTS[0])
    assert later.output_ids == alone(smollm2, PROMPTS[1])
    assert_nothing_leaked(engine)


def test_a_pool_too_small_preempts_and_loses_nothing(smollm2) -> None:
    params = SamplingParams(max_new_tokens=20)
    engine = LLMEngine(smollm2, EngineConfig(num_blocks=4, block_size=8, max_tokens_per_step=64))  # 32 slots
    requests = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(PROMPTS[:4])]
    drain(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for request, prompt in zip(requests, PROMPTS):
        assert request.output_ids == alone(smollm2, prompt, params), prompt
    assert_nothing_leaked(engine)


def test_cancel_frees_every_block(smollm2) -> None:
    engine = LLMEngine(smollm2, EngineConfig(num_blocks=64, prefix_cache=False))
    keep = engine.add_request("keep", PROMPTS[0], PARAMS)
    drop = engine.add_request("drop", PROMPTS[3], SamplingParams(max_new_tokens=50))
    queued = engine.add_request("queued", PROMPTS[2], PARAMS)
    engine.step()
    engine.step()
    held_by_drop = len(drop.cache.blocks)
    in_use = engine.scheduler.num_blocks_in_use()
    output = engine.cancel("drop")
    assert output.finished and output.finish_reason == "cancelled" and drop.cache is None
    assert engine.scheduler.num_blocks_in_use() == in_use - held_by_drop
    assert engine.cancel("drop") is None  # twice is harmless
    drain(engine, [keep, queued])
    assert keep.output_ids == alone(smollm2, PROMPTS[0])
    assert_nothing_leaked(engine)


def test_a_failed_forward_fails_its_requests_and_frees_them(smollm2, monkeypatch) -> None:
    engine = LLMEngine(smollm2, EngineConfig(num_blocks=64))
    requests = [engine.add_request(f"r{i}", p, PARAMS) for i, p in enumerate(PROMPTS[:2])]
    engine.step()

    def broken(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(engine.model, "forward_batch", broken)
    outputs = engine.step()
    assert {o.finish_reason for o in outputs} == {"error"} and "simulated" in outputs[0].error
    assert not engine.has_unfinished()
    assert_nothing_leaked(engine)


def test_bad_requests_are_rejected_and_change_nothing(smollm2) -> None:
    engine = LLMEngine(smollm2, EngineConfig(num_blocks=2, max_context=64))
    engine.add_request("ok", PROMPTS[0], PARAMS)
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("empty", "", PARAMS)
    with pytest.raises(PromptTooLongError, match="shorten it"):
        engine.add_request("long", list(range(100)), PARAMS)
    with pytest.raises(ValueError, match="more KV blocks than the whole pool"):
        engine.add_request("huge", PROMPTS[0], SamplingParams(max_new_tokens=500))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("vocab", [10**9], PARAMS)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("ok", PROMPTS[1], PARAMS)
    assert list(engine.requests) == ["ok"] and len(engine.scheduler.waiting) == 1
    engine.check_invariants()


def test_priorities_run_first(smollm2) -> None:
    engine = LLMEngine(smollm2, EngineConfig(num_blocks=64, max_num_seqs=1))
    low = engine.add_request("low", PROMPTS[0], PARAMS, priority=5)
    high = engine.add_request("high", PROMPTS[1], PARAMS, priority=0)
    engine.step()
    assert high.status is RequestStatus.RUNNING and low.status is RequestStatus.WAITING
    drain(engine, [low, high])


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_prefix_cache_hit_equals_recompute(name, request) -> None:
    """A shared system prompt is computed once; the second request reuses it (Gemma 3's sliding
    layers included) and still produces exactly the tokens of a run without any cache."""
    llm = request.getfixturevalue(name)
    engine = LLMEngine(llm, EngineConfig(num_blocks=64))
    first = engine.add_request("first", SYSTEM + PROMPTS[0], PARAMS)
    drain(engine, [first])
    second = engine.add_request("second", SYSTEM + PROMPTS[1], PARAMS)
    other_salt = engine.add_request("salted", SYSTEM + PROMPTS[1], PARAMS, salt="tenant-b")
    drain(engine, [second, other_salt])
    assert first.miss_reason == "no match" and first.cached_tokens == 0
    assert second.miss_reason == "hit" and second.cached_tokens >= 16
    assert other_salt.miss_reason == "different salt" and other_salt.cached_tokens == 0
    assert second.output_ids == alone(llm, SYSTEM + PROMPTS[1])
    stats = engine.scheduler.prefix.stats
    assert stats.hits == 1 and stats.tokens_reused == second.cached_tokens
    engine.scheduler.prefix.clear()
    evicted = engine.add_request("again", SYSTEM + PROMPTS[2], PARAMS)
    drain(engine, [evicted])
    assert evicted.miss_reason == "evicted"
    assert_nothing_leaked(engine)


@torch.inference_mode()
def test_sampled_requests_with_a_seed_repeat(smollm2) -> None:
    params = SamplingParams(max_new_tokens=8, temperature=0.8, seed=7)
    engine = LLMEngine(smollm2, EngineConfig(num_blocks=64))
    a, b = engine.generate([PROMPTS[0], PROMPTS[0]], params)
    assert a.output_ids == b.output_ids
    assert_nothing_leaked(engine)
