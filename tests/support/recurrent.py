"""Checks shared by the state-space families' tests (Mamba, Mamba-2, Granite 4.0-H, LFM2, Nemotron-H, Falcon-H1)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvgen import LLM, SamplingParams
from kvgen.engine import EngineConfig, LLMEngine
from kvgen.kv.hybrid import HybridStateCache
from kvgen.kv.ssm import materialized
from kvgen.speculative.proposer import Draft, DraftPolicy, Proposer


def random_ids(count: int, seed: int) -> list[int]:
    """`count` token ids drawn from SmolLM2's vocabulary (the tiny models'), seeded."""
    return torch.randint(0, 49152, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_idle(engine: LLMEngine) -> None:
    """A state model's engine runs nothing and every unit in use is the prefix cache's (its
    snapshots, and a hybrid's blocks of keys and values)."""
    engine.check_invariants()
    prefix = engine.scheduler.prefix
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.scheduler.num_blocks_in_use() == (prefix.num_units if prefix else 0)


def transformers_greedy(model: Any, ids: list[int], count: int) -> list[int]:
    """transformers' greedy `generate` of `count` tokens after `ids` (a decoder-only model)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=count, do_sample=False, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def prefill_and_steps(llm: LLM, prompt: list[int], more: list[int], adapter: str | None = None) -> torch.Tensor:
    """kvgen's logits at every prompt position, then after each of `more` decoded one at a time [S, V]
    (under LoRA `adapter` where one is named)."""
    with torch.inference_mode():
        cache = llm.generator.new_cache(0)
        prefill = llm.model(torch.tensor([prompt]), cache, logits_to_keep=len(prompt), adapter=adapter)[0]
        return torch.cat([prefill, *(llm.model(torch.tensor([[t]]), cache, adapter=adapter)[0] for t in more)])


def assert_c_step_follows_torch(llm: LLM, prompt: list[int], more: list[int], monkeypatch: pytest.MonkeyPatch,
                                prompt_tolerance: float = 1e-4) -> float:  # fmt: skip
    """`llm` (quantized projections) decodes in C; its torch step (c_decode off) over the same
    linears must give the same logits up to the order of float sums and the same greedy tokens.
    `prompt_tolerance`: for the prompt's positions, whose attention blocks a hybrid also runs in C
    (a mixture's router may flip a near tie there). Returns the largest logit difference."""
    params = SamplingParams(max_new_tokens=len(more), ignore_eos=True)
    in_c, c_tokens = prefill_and_steps(llm, prompt, more), llm.generate(prompt, params).token_ids
    assert llm.model._step is not None
    with monkeypatch.context() as patch:
        patch.setattr(llm.model, "c_decode", False)
        in_torch, torch_tokens = prefill_and_steps(llm, prompt, more), llm.generate(prompt, params).token_ids
    difference = (in_c - in_torch).abs().max().item()
    assert (in_c - in_torch)[len(prompt) :].abs().max().item() < 1e-4
    assert (in_c - in_torch)[: len(prompt)].abs().max().item() < prompt_tolerance
    assert c_tokens == torch_tokens
    return difference


def assert_session_resumes_from_a_checkpoint(llm: LLM, params: SamplingParams, shared: list[int], first_more: list[int],
                                             second_more: list[int]) -> None:  # fmt: skip
    """A session's next prompt sharing `shared` (150 tokens) with its first resumes at the checkpoint
    at 128 (they come every 64) and generates what a fresh run does."""
    first, second = shared + first_more, shared + second_more
    session = llm.session()
    for _ in session.stream(first, params):
        pass
    assert session.cache.checkpoints[:3] == [0, 64, 128]
    stream = session.stream(second, params)
    for _ in stream:
        pass
    assert stream.result.usage.cached_tokens == 128  # the latest checkpoint within the shared tokens
    assert stream.result.token_ids == llm.generate(second, params).token_ids  # == from scratch
    session.cache.check_invariants()
    session.close()


def assert_batched_rows_equal_each_row_alone(llm: LLM, histories: list[list[int]], news: list[list[int]], state_tolerance: float) -> None:
    """Ragged rows with histories of different lengths in one pass (forward_batch), each capturing its
    own checkpoints (every 8 tokens): the same logits, states and checkpoints as each row run alone."""
    model = llm.model
    with torch.inference_mode():
        alone, batched = [], [model.new_state_cache(checkpoint_every=8) for _ in histories]
        for history, cache in zip(histories, batched):
            if history:
                model(torch.tensor([history]), cache)
        singles = [cache.fork() for cache in batched]
        for new, cache in zip(news, singles):
            alone.append(model(torch.tensor([new]), cache)[0, -1])
        together = model.forward_batch(news, batched)  # [rows, V]
    assert (together - torch.stack(alone)).abs().max().item() < 1e-5
    for b, s in zip(batched, singles):
        assert b.seq_len == s.seq_len and b.checkpoints == s.checkpoints
        for layer in range(b.spec.num_layers):
            assert torch.allclose(b.recurrent_state(layer), s.recurrent_state(layer), atol=state_tolerance)
            assert torch.allclose(b.conv_state(layer), s.conv_state(layer), atol=1e-6)  # batched GEMMs round differently


def assert_c_rows_equal_each_row_alone(llm: LLM, histories: list[list[int]], tokens: list[int]) -> None:
    """One token for each of several sequences in one C call (`llm`: quantized projections): the
    same logits and states, bit for bit, as each sequence's token run alone; and so in a step that
    also holds a prompt chunk (the engine's chunked prefill beside its decodes)."""
    model = llm.model
    with torch.inference_mode():
        caches = [model.new_state_cache() for _ in histories]
        mixed = [model.new_state_cache() for _ in histories]
        for history, cache, twin in zip(histories, caches, mixed):
            model(torch.tensor([history]), cache)
            model(torch.tensor([history]), twin)
        singles = [cache.fork() for cache in caches]
        together = model.forward_batch([[t] for t in tokens], caches)  # [rows, V]
        alone = torch.cat([model(torch.tensor([[t]]), cache)[0] for t, cache in zip(tokens, singles)])
        chunk = histories[0][:6]  # a prompt's first chunk, second among the rows, two logits asked
        beside = model.forward_batch([[tokens[0]], chunk, *([t] for t in tokens[1:])], [mixed[0], model.new_state_cache(), *mixed[1:]],
                                     [1, 2] + [1] * (len(tokens) - 1))  # fmt: skip
        chunk_alone = model(torch.tensor([chunk]), model.new_state_cache(), logits_to_keep=2)[0]
    assert model._step is not None
    assert torch.equal(together, alone)
    assert torch.equal(torch.cat([beside[:1], beside[3:]]), alone)
    assert (beside[1:3] - chunk_alone).abs().max().item() < 1e-4  # the chunk's scan, batched or not
    for b, s in zip(caches, singles):
        for layer in range(b.spec.num_layers):
            assert torch.equal(b.recurrent_state(layer), s.recurrent_state(layer))
            assert torch.equal(b.conv_state(layer), s.conv_state(layer))
        if hasattr(b, "kv"):  # a hybrid's attention layers: the keys and values each row wrote
            assert b.kv.seq_len == s.kv.seq_len == b.seq_len
            none = torch.empty(1, b.kv.spec.num_kv_heads, 0, b.kv.spec.head_dim)
            for layer in range(b.kv.spec.num_layers):
                with torch.inference_mode():  # an update of no positions: the history as views
                    history = b.kv.update(layer, none, none), s.kv.update(layer, none, none)
                assert all(torch.equal(got, want) for got, want in zip(*history))


def assert_a_chain_is_one_token_steps(llm: LLM, prompt: list[int], more: list[int], adapter: str | None = None) -> None:
    """`more` (at most 8 tokens) after `prompt` as one pass that keeps every position's state (a
    speculative verify): the C step runs it as a chain, and each position's logits and the states
    after it equal one-token decode steps' bit for bit (under LoRA `adapter` where one is named)."""
    model = llm.model
    scans = []
    with torch.inference_mode(), pytest.MonkeyPatch.context() as patch:
        stepped, chained = model.new_state_cache(), model.new_state_cache()
        for cache in (stepped, chained):
            model(torch.tensor([prompt]), cache, adapter=adapter)
        logits, states = [], []
        for token in more:
            logits.append(model(torch.tensor([[token]]), stepped, adapter=adapter)[0])
            states.append([(stepped.conv_state(i).clone(), stepped.recurrent_state(i).clone()) for i in range(stepped.spec.num_layers)])
        scan = model._scan_batch
        patch.setattr(model, "_scan_batch", lambda *args: scans.append(args) or scan(*args))
        chained.keep_positions = True
        verified = model(torch.tensor([more]), chained, logits_to_keep=len(more), adapter=adapter)[0]
    assert not scans, "the verify ran the prompt scan, not the C chain"
    assert torch.equal(verified, torch.cat(logits)), (verified - torch.cat(logits)).abs().max().item()
    kept = {**{p: materialized(states) for p, states in chained._positions.items()}, chained.seq_len: [(chained.conv_state(i), chained.recurrent_state(i)) for i in range(chained.spec.num_layers)]}
    for position, expected in enumerate(states, start=len(prompt) + 1):
        for layer, ((conv, recurrent), (want_conv, want_recurrent)) in enumerate(zip(kept[position], expected)):
            assert torch.equal(conv, want_conv) and torch.equal(recurrent, want_recurrent), (position, layer)


def assert_prefill_is_chunk_invariant(llm: LLM, ids: list[int], splits: list[list[int]], adapter: str | None = None) -> None:
    """The last logits of a prompt run whole equal, bit for bit, those of the same prompt run in the
    chunks of each split (chunk lengths summing to len(ids)), as the engine splits prompts; under
    LoRA `adapter` where one is named."""
    with torch.inference_mode():
        whole = llm.model(torch.tensor([ids]), llm.model.new_state_cache(), logits_to_keep=2, adapter=adapter)[0]
        for chunks in splits:
            assert sum(chunks) == len(ids)
            cache, start = llm.model.new_state_cache(), 0
            for length in chunks:
                logits = llm.model(torch.tensor([ids[start : start + length]]), cache, logits_to_keep=min(2, length), adapter=adapter)[0]
                start += length
            assert torch.equal(logits[-1], whole[-1]), f"split {chunks}: {(logits[-1] - whole[-1]).abs().max().item()}"


def assert_engine_and_prefix_hit_follow_transformers(model: Any, llm: LLM, params: SamplingParams, prompts: list[str]) -> None:
    """A hybrid's engine against transformers' greedy tokens (`model`: its HF model): `prompts` and a
    60-token one run together (prefills chunked beside decodes); a prompt sharing 52 tokens with an
    earlier one resumes at the last block boundary inside them (48, block size 8: its states and keys
    restored) and decodes transformers' tokens; the prefix cache's units are all the budget holds
    once the requests end."""
    count = params.max_new_tokens
    encoded = [llm.tokenizer.encode(p) for p in prompts] + [random_ids(60, 7)]
    engine = LLMEngine(llm, EngineConfig(max_tokens_per_step=24, block_size=8))
    for ids, request in zip(encoded, engine.generate(encoded, params)):
        assert request.output_ids == transformers_greedy(model, ids, count)
    shared = random_ids(52, 60)
    engine.generate([shared + random_ids(6, 61)], params)
    second = shared + random_ids(9, 62)
    (request,) = engine.generate([second], params)
    assert request.cached_tokens == 48 and request.miss_reason == "hit"
    assert request.output_ids == transformers_greedy(model, second, count)
    engine.check_invariants()
    assert engine.scheduler.num_blocks_in_use() == engine.scheduler.prefix.num_units > 0


def assert_logits_follow_transformers(model: Any, llm: LLM, prompt_tokens: int, every: int, tolerance: float) -> None:
    """A hybrid's logits at every position of a `prompt_tokens` prefill (checkpoints every `every`)
    and 6 decode steps after it, against transformers' forward (`model`) over the same tokens."""
    prompt, more = random_ids(prompt_tokens, 1), random_ids(6, 2)
    with torch.inference_mode():
        cache = llm.model.new_state_cache(checkpoint_every=every)
        assert isinstance(cache, HybridStateCache)
        prefill = llm.model(torch.tensor([prompt]), cache, logits_to_keep=len(prompt))[0]
        steps = torch.cat([llm.model(torch.tensor([[t]]), cache)[0] for t in more])
        expected = model(torch.tensor([prompt + more])).logits[0]
    assert cache.checkpoints[:3] == [0, every, 2 * every] and cache.kv.seq_len == cache.seq_len == prompt_tokens + 6
    assert (prefill - expected[: len(prompt)]).abs().max().item() < tolerance
    assert (steps - expected[len(prompt) :]).abs().max().item() < tolerance


def assert_engine_tokens_equal_each_request_alone(llm: LLM, params: SamplingParams) -> None:
    """Three prompts of different lengths through the engine (prefills chunked beside decodes) give
    the tokens each gives alone through LLM.generate."""
    prompts = [random_ids(n, 40 + n) for n in (5, 33, 18)]
    engine = LLMEngine(llm, EngineConfig(max_tokens_per_step=16, block_size=8))
    assert [r.output_ids for r in engine.generate(prompts, params)] == [llm.generate(p, params).token_ids for p in prompts]


class SpoiledOracle(Proposer):
    """Drafts plain decoding's next tokens (a `truth`: a prompt + its greedy output; the one the ids
    so far begin), the last of every draft of three or more replaced by another token: such drafts
    are accepted up to it, then rejected there."""

    drafts_for_free = True  # as prompt lookup's, which it stands in for: the engine lets every decoding request draft

    def __init__(self, *truths: list[int]):
        self.truths = truths

    def propose(self, ids: list[int], num_tokens: int, policy: DraftPolicy, constraint: Any) -> Draft:
        truth = next(truth for truth in self.truths if truth[: len(ids)] == ids)
        tokens = truth[len(ids) : len(ids) + num_tokens]
        if len(tokens) >= 3:
            tokens[-1] = (tokens[-1] + 1) % 49152
        return Draft(tokens)
