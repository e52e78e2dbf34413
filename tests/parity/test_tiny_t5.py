"""T5 against transformers' T5ForConditionalGeneration on the same weights, and its encoder cache.

No T5 checkpoint installs offline: these are small random-weight models that transformers itself
builds and saves (tests/support/tiny_hf.py), the only evidence for this family.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvgen import LLM, SamplingParams
from tests.support.models import PROMPTS
from tests.support.tiny_hf import save_tiny_t5, tokenizer_folder

pytestmark = pytest.mark.slow
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def t5(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, LLM]]:
    """"gated": Flan-T5's shape (gated-gelu, no output rescale); "relu": T5 v1.0's (relu, rescaled before the head)."""
    tokenizer = tokenizer_folder(tmp_path_factory.mktemp("tokenizer"))
    models = {}
    for name, gated in (("gated", True), ("relu", False)):
        folder = tmp_path_factory.mktemp(f"t5-{name}")
        models[name] = (save_tiny_t5(folder, tokenizer, gated=gated), LLM.load(folder, progress=False, weights="fp32"))
    return models


def reference_greedy(model: Any, ids: list[int], count: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=count, min_new_tokens=count, do_sample=False)
    return out[0, 1:].tolist()  # after the decoder start token


@pytest.mark.parametrize("name", ["gated", "relu"])
def test_first_step_and_decode_logits_match(name: str, t5: dict) -> None:
    model, llm = t5[name]
    ids = llm.tokenizer.encode(PROMPTS[0])
    decoded = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        cache = llm.generator.new_cache(0)
        first = llm.model(torch.tensor([ids]), cache)[0, -1]  # encoder + the decoder's start token
        steps = torch.stack([first] + [llm.model(torch.tensor([[t]]), cache)[0, -1] for t in decoded])
        decoder_ids = torch.tensor([[model.config.decoder_start_token_id] + decoded])
        expected = model(input_ids=torch.tensor([ids]), decoder_input_ids=decoder_ids).logits[0]  # [41, V]
    assert (steps - expected).abs().max().item() < TOLERANCE
    cache.release()


def test_greedy_tokens_match_on_four_prompts(t5: dict) -> None:
    model, llm = t5["gated"]
    for prompt in PROMPTS[:4]:
        ids = llm.tokenizer.encode(prompt)
        result = llm.generate(ids, SamplingParams(max_new_tokens=48, ignore_eos=True))
        assert result.token_ids == reference_greedy(model, ids, 48), prompt


def test_eight_requests_over_two_inputs_run_the_encoder_twice(t5: dict) -> None:
    model, llm = t5["relu"]
    inputs = [PROMPTS[1], PROMPTS[3]] * 4
    runs_before, misses_before = llm.model.encoder_runs, llm.model.encoder_cache.stats["misses"]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    results = [llm.generate(prompt, params) for prompt in inputs]
    assert llm.model.encoder_runs - runs_before == 2  # not 8: cross-attention K/V reused from the cache
    assert llm.model.encoder_cache.stats["misses"] - misses_before == 2
    references = {p: reference_greedy(model, llm.tokenizer.encode(p), 12) for p in set(inputs)}
    assert [r.token_ids for r in results] == [references[p] for p in inputs]
    llm.model.encoder_cache.check_invariants()
    assert all(entry.refs == 0 for entry in llm.model.encoder_cache._entries.values())  # every request released


def test_weight_modes_t5_does_not_run_refuse_clearly(t5: dict) -> None:
    _, llm = t5["gated"]
    with pytest.raises(ValueError, match="fp32"):
        LLM.load(llm.path, progress=False, weights="int8")
