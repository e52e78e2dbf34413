"""Greedy output on the default weights depends neither on the decode batch nor on speculation: 24
requests of mixed lengths, each arriving while the others decode, produce exactly the tokens they
produce alone, and so does every speculative method, in the engine and for one sequence.

Why it holds: decodes and speculative verifies always run the C step over every layer
(kernels/decode.c), a kernel row per token, alone or batched, and its one-row GEMV sums in the order
of the tiled GEMM, so a row's logits are the same bits in a batch of one or of 24, and a verified
position gets the logits a decode would give it; the engine runs decodes and verifies in their own
forward, apart from prompt chunks (engine/runner.py). What stays variant: prompts prefilled in one
forward together (a padded batch, another GEMM shape) round differently from a prompt alone
(docs/engine.md, "Batch invariance"), and so does a prompt cut in chunks, so here each step
admits one new prompt and the step budget holds every prompt whole."""

from __future__ import annotations

import pytest
import torch

from kvgen import LLM, SamplingParams
from kvgen.engine import EngineConfig, LLMEngine, RequestStatus
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
    methods = [SpeculativeConfig("lookup"), SpeculativeConfig("self"), SpeculativeConfig("draft", draft_model=llm)]
    if name == "smollm2":  # the shipped EAGLE head is trained for SmolLM2
        methods.append(SpeculativeConfig("eagle"))
    for speculative in methods:
        results = [llm.generate(p, PARAMS, speculative=speculative) for p in prompts[:6]]
        different = [i for i, r in enumerate(results) if r.token_ids != alone[i]]
        assert not different, f"{speculative.method}: prompts {different} differ from plain decoding"
        assert sum(r.speculative.verify_steps for r in results) > 0, f"{speculative.method}: nothing was verified"
