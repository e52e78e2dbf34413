"""Sampled speculative decoding follows the target's distribution (chi-square goodness of fit).

Each trial rewinds the target's cache to the prompt, runs one speculative step (draft k tokens,
verify, accept or resample) with a fresh seed, and records the first token. Its law must be the
target's processed distribution p at that position, whatever the draft proposed."""

from __future__ import annotations

import pytest
import torch

from kvgen import LLM, SamplingParams, SpeculativeConfig
from kvgen.sampling.sampler import Sampler
from kvgen.speculative.decoder import SpeculativeDecoder
from tests.speculative.stats import CHI2_CRITICAL_0_001, binned, chi_square
from tests.support.tiny_gguf import write_tiny_gguf


def first_token_counts(llm: LLM, prompt_ids: list[int], params: SamplingParams, config: SpeculativeConfig,
                       trials: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """-> (counts over the bins, bin probabilities): bins are p's most likely tokens plus 'other'."""
    generator = llm.generator
    cache = generator.new_cache(len(prompt_ids) + 16)
    with torch.inference_mode():
        llm.model(torch.tensor([prompt_ids[:-1]]), cache)
        logits = llm.model(torch.tensor([prompt_ids[-1:]]), cache.fork())[0, -1]
    p = Sampler(params).probabilities(logits)
    ids, bin_probs = binned(p, top=min(params.top_k, 8) - 1)
    counts = torch.zeros(len(bin_probs))
    decoder = None
    for trial in range(trials):
        cache.truncate(len(prompt_ids) - 1)
        sampler = Sampler(SamplingParams(temperature=params.temperature, top_k=params.top_k, seed=trial))
        if decoder is None:  # one proposer for every trial: its own cache is rewound by the decoder
            decoder = SpeculativeDecoder(llm.model, cache, config.build_proposer(generator), sampler, config, generator.max_context)
        decoder.sampler = sampler
        decoder.policy.sampler.generator.manual_seed(10_000 + trial)
        decoder.start(list(prompt_ids))
        with torch.inference_mode():
            token = decoder.step(max_tokens=8)[0]
        hit = (ids == token).nonzero()
        counts[int(hit[0, 0]) if len(hit) else -1] += 1
    assert decoder is not None and decoder.stats.verify_steps == trials
    assert decoder.stats.accepted_tokens < decoder.stats.proposed_tokens  # rejections were exercised
    decoder.proposer.release()
    return counts, bin_probs


@pytest.mark.slow  # 600 speculative steps: ~30 s on a quiet machine
def test_tiny_model_with_a_different_draft_model(tmp_path):
    target = LLM.load(write_tiny_gguf(tmp_path / "target.gguf", seed=0), progress=False, weights="fp32")
    draft = LLM.load(write_tiny_gguf(tmp_path / "draft.gguf", seed=1), progress=False, weights="fp32")
    params = SamplingParams(temperature=1.0, top_k=6)
    config = SpeculativeConfig("draft", num_draft_tokens=3, adaptive=False, draft_model=draft)
    counts, probs = first_token_counts(target, target.tokenizer.encode("hello wor"), params, config, trials=600)
    assert chi_square(counts, probs) < CHI2_CRITICAL_0_001[len(probs) - 1]


@pytest.mark.slow
def test_smollm2_first_token_with_a_layer_skip_draft(smollm2):
    params = SamplingParams(temperature=1.5, top_k=5)
    config = SpeculativeConfig("self", num_draft_tokens=2, adaptive=False, draft_layers=10)
    prompt = smollm2.tokenizer.encode("The three primary colors are")
    counts, probs = first_token_counts(smollm2, prompt, params, config, trials=240)
    assert chi_square(counts, probs) < CHI2_CRITICAL_0_001[len(probs) - 1]
