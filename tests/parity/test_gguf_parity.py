"""kvgen vs transformers on the same GGUF weights: greedy tokens and last-position logits."""

from __future__ import annotations

import pytest
import torch

from kvgen import SamplingParams
from tests.conftest import MODEL_NAMES, load_llm, load_reference
from tests.support.models import PROMPTS

pytestmark = pytest.mark.slow
NEW_TOKENS = 48
LOGIT_TOLERANCE = 1e-3


def reference_greedy(model, input_ids: torch.Tensor, new_tokens: int) -> list[int]:
    """transformers' greedy generate(); it stops at (and includes) the model's EOS token.

    No min_new_tokens: that would mask EOS logits and change the argmax.
    """
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0)  # fmt: skip
    return out[0, input_ids.shape[1] :].tolist()


def kvgen_greedy(llm, model, ids: list[int], new_tokens: int) -> list[int]:
    """kvgen's greedy output, stopping on exactly the EOS ids transformers stops on."""
    eos = model.generation_config.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True, stop_token_ids=eos_ids)
    return llm.generate(ids, params).token_ids


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_prompt_ids_equal_reference_tokenizer(name: str) -> None:
    llm, (_, tokenizer) = load_llm(name), load_reference(name)
    for prompt in PROMPTS:
        assert llm.tokenizer.encode(prompt) == tokenizer(prompt).input_ids


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_greedy_tokens_equal_reference(name: str) -> None:
    llm, (model, tokenizer) = load_llm(name), load_reference(name)
    full_length = 0
    for prompt in PROMPTS:
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
        expected = reference_greedy(model, input_ids, NEW_TOKENS)
        assert kvgen_greedy(llm, model, input_ids[0].tolist(), NEW_TOKENS) == expected, prompt
        full_length += len(expected) == NEW_TOKENS
    assert full_length >= 4  # the bar: 48 tokens equal on at least 4 prompts


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_last_position_logits_match_reference(name: str) -> None:
    llm, (model, tokenizer) = load_llm(name), load_reference(name)
    for prompt in PROMPTS:
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            expected = model(input_ids).logits[0, -1]
            cache = llm.generator.new_cache(input_ids.shape[1])
            actual = llm.model(input_ids, cache)[0, -1]
        assert (actual - expected).abs().max().item() < LOGIT_TOLERANCE


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_decode_step_logits_match_reference(name: str) -> None:
    """The cached decode path (one token at a time) gives the logits of a full forward pass."""
    llm, (model, tokenizer) = load_llm(name), load_reference(name)
    input_ids = tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    with torch.inference_mode():
        expected = model(input_ids).logits[0]  # [S, V]
        cache = llm.generator.new_cache(input_ids.shape[1])
        llm.model(input_ids[:, :4], cache)
        for position in range(4, input_ids.shape[1]):
            actual = llm.model(input_ids[:, position : position + 1], cache)[0, -1]
            assert (actual - expected[position]).abs().max().item() < LOGIT_TOLERANCE
