"""Greedy output on the default weights depends neither on the batch, nor on how prompts are
chunked, nor on speculation: 24 requests of mixed lengths, each arriving while the others decode, or
all at once under a small step budget (prompts cut into chunks, several prompts' chunks in one
forward), produce exactly the tokens they produce alone, and so does every speculative method, in
the engine and for one sequence.

Why it holds: every token, prompt or decoded, runs the C step over every layer (kernels/decode.c),
a kernel row per token, alone or batched, whose linears sum in one order at every row count and
whose attention computes each query as a lone decode does; so a row's logits and its cache entries
are the same bits in a batch of one or of 24, in a prompt prefilled whole or in any chunks, and a
verified position gets the logits a decode would give it."""

from __future__ import annotations

import pytest
import torch

from kvgen import LLM, SamplingParams
from kvgen.engine import EngineConfig, LLMEngine, RequestStatus
from kvgen.kv import CacheSpec, ContiguousCache
from kvgen.speculative.config import SpeculativeConfig
from tests.support.models import PROMPTS, model_path
from tests.support.shakespeare import play_text

PARAMS = SamplingParams(max_new_tokens=27, ignore_eos=True)  # the first request is still decoding when the 24th arrives


def mixed_prompts(llm: LLM, count: int) -> list:
    """Chat-sized prompts, short snippets and a few hundred tokens of Hamlet."""
    ids = llm.tokenizer.encode(play_text("hamlet"))
    lengths = [5, 12, 40, 150, 120, 17, 70, 9]
    prompts: list = list(PROMPTS[:3])
    for i in range(count - len(prompts)):
        start = 97 * i
        prompts.append(ids[start : start + lengths[i % len(lengths)]])
    return prompts


_loaded: dict[str, tuple[LLM, list, list]] = {}


def default_weights(name: str) -> tuple[LLM, list, list]:
    """The model on its default weights (4-bit / 8-bit blocks), 24 prompts and each one's greedy
    tokens generated alone (batch-1 C step), loaded once for this module."""
    if name not in _loaded:
        llm = LLM.load(model_path(name), progress=False)
        prompts = mixed_prompts(llm, 24)
        with torch.inference_mode():
            alone = [llm.generate(p, PARAMS).token_ids for p in prompts]
        _loaded[name] = llm, prompts, alone
    return _loaded[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_24_concurrent_requests_equal_each_request_alone(name: str) -> None:
    llm, prompts, alone = default_weights(name)
    engine = LLMEngine(llm, EngineConfig(kv_budget_mb=256, max_tokens_per_step=512, max_num_seqs=24))
    requests, waiting, most_running = [], list(enumerate(prompts)), 0
    while waiting or any(r.status is not RequestStatus.FINISHED for r in requests):
        if waiting:  # one arrival per step: its prefill overlaps the others' decodes
            i, prompt = waiting.pop(0)
            requests.append(engine.add_request(f"r{i}", prompt, PARAMS))
        engine.step()
        engine.check_invariants()
        most_running = max(most_running, len(engine.scheduler.running))
    assert most_running == 24  # all of them decoded together at the end
    different = [i for i, (r, a) in enumerate(zip(requests, alone)) if r.output_ids != a]
    assert not different, f"requests {different} differ from their run alone"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_speculative_decoding_gives_the_greedy_tokens_of_plain_decoding(name: str) -> None:
    """Every method verifies its drafts in the C step, one kernel row per position, each computed as
    a lone decode would compute it: 8 concurrent requests (verifies batched beside each other and
    beside decodes) produce exactly the tokens plain decoding produces alone."""
    llm, prompts, alone = default_weights(name)
    methods = [SpeculativeConfig("lookup"), SpeculativeConfig("self"), SpeculativeConfig("draft", draft_model=llm)]
    for speculative in methods:  # (the EAGLE head reads hidden states the engine does not keep: not in the engine)
        engine = LLMEngine(llm, EngineConfig(kv_budget_mb=128, max_tokens_per_step=1024, max_num_seqs=8))
        requests = []
        for i, prompt in enumerate(prompts[:8]):  # one arrival per step: prompts prefilled alone
            requests.append(engine.add_request(f"r{i}", prompt, PARAMS, speculative=speculative))
            engine.step()
        while engine.has_unfinished():
            engine.step()
            engine.check_invariants()
        totals = engine.speculative_totals
        assert totals.verify_steps > 0, f"{speculative.method}: nothing was verified"
        if speculative.method == "lookup":  # accepted drafts' keys and values stay in the cache
            assert totals.accepted_tokens > 0
        different = [i for i, r in enumerate(requests) if r.output_ids != alone[i]]
        assert not different, f"{speculative.method}: requests {different} differ from plain decoding alone"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_speculative_generate_gives_the_greedy_tokens_of_plain_decoding(name: str) -> None:
    """One sequence (`LLM.generate`): the target verifies every method's drafts (the EAGLE head's
    too, through the C step's hidden states) as a kernel row per position, so the greedy tokens
    equal plain decoding's."""
    llm, prompts, alone = default_weights(name)
    # The model-drafting methods at a fixed length. Adaptive, each first drafts a probe checked by
    # one-token steps, which passes only if drafting took under 0.9 of the plain steps it saved: on
    # a loaded machine the timings can fail every probe, and no batched verify is ever run.
    methods = [
        SpeculativeConfig("lookup"),
        SpeculativeConfig("self", num_draft_tokens=2, adaptive=False),
        SpeculativeConfig("draft", draft_model=llm, num_draft_tokens=2, adaptive=False),
    ]
    if name == "smollm2":  # the shipped EAGLE head is trained for SmolLM2
        methods.append(SpeculativeConfig("eagle", num_draft_tokens=2, adaptive=False))
    for speculative in methods:
        results = [llm.generate(p, PARAMS, speculative=speculative) for p in prompts[:6]]
        different = [i for i, r in enumerate(results) if r.token_ids != alone[i]]
        assert not different, f"{speculative.method}: prompts {different} differ from plain decoding"
        assert sum(r.speculative.verify_steps for r in results) > 0, f"{speculative.method}: nothing was verified"



def prefill_in_chunks(model, prompt: list[int], chunks: list[int]) -> tuple[torch.Tensor, ContiguousCache]:
    """`prompt` prefilled `chunks[i]` tokens at a time into a fresh cache -> the last logits [V] and the cache."""
    cache = ContiguousCache(CacheSpec.for_model(model.config), len(prompt))
    start = 0
    with torch.inference_mode():
        for n in chunks:
            logits = model(torch.tensor([prompt[start : start + n]]), cache)[0, -1]
            start += n
    assert start == len(prompt) == cache.seq_len
    return logits, cache


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_a_prompt_in_chunks_gives_the_bits_of_the_whole_prompt(name: str) -> None:
    """Logits and every layer's keys and values of a prompt prefilled whole equal, bit for bit, those
    of the same prompt in chunks (56 + 8, 17 + 30 + 17, one token at a time: each a decode step);
    Gemma 3's second prompt runs past its 512-token sliding window, cut around it."""
    model = default_weights(name)[0].model
    ids = default_weights(name)[0].tokenizer.encode(play_text("hamlet"))
    cases = [(64, [[56, 8], [17, 30, 17], [1] * 64])]
    window = model.config.sliding_window
    if window is not None:
        cases.append((window + 30, [[window - 2, 32], [window + 29, 1]]))
    for length, splits in cases:
        whole, whole_cache = prefill_in_chunks(model, ids[:length], [length])
        expected = whole_cache.kernel_layout(length)
        for chunks in splits:
            logits, cache = prefill_in_chunks(model, ids[:length], chunks)
            assert torch.equal(logits, whole), (chunks[:4], (logits - whole).abs().max().item())
            layout = cache.kernel_layout(length)
            assert torch.equal(layout.keys[..., :length, :], expected.keys[..., :length, :]), chunks[:4]
            assert torch.equal(layout.values[..., :length, :], expected.values[..., :length, :]), chunks[:4]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_all_24_at_once_under_a_small_step_budget_equal_each_request_alone(name: str) -> None:
    """Chunked prefill: a 40-token step budget cuts the longer prompts into chunks (the last one
    often a token or two), and several requests' chunks share a forward."""
    llm, prompts, alone = default_weights(name)
    engine = LLMEngine(llm, EngineConfig(kv_budget_mb=256, max_tokens_per_step=40, max_num_seqs=24))
    requests = [engine.add_request(f"r{i}", prompt, PARAMS) for i, prompt in enumerate(prompts)]
    most_chunk_rows = 0
    original = engine.runner._run_group

    def run_group(rows):
        nonlocal most_chunk_rows
        most_chunk_rows = max(most_chunk_rows, sum(not row.request.is_decoding for row in rows))
        return original(rows)

    engine.runner._run_group = run_group
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
    assert most_chunk_rows > 1  # prompt chunks of several requests in one forward
    different = [i for i, (r, a) in enumerate(zip(requests, alone)) if r.output_ids != a]
    assert not different, f"requests {different} differ from their run alone"
