"""Checks shared by the state-space families' tests (Mamba, Mamba-2)."""

from __future__ import annotations

import pytest
import torch

from kvgen import LLM, SamplingParams


def prefill_and_steps(llm: LLM, prompt: list[int], more: list[int]) -> torch.Tensor:
    """kvgen's logits at every prompt position, then after each of `more` decoded one at a time [S, V]."""
    with torch.inference_mode():
        cache = llm.generator.new_cache(0)
        prefill = llm.model(torch.tensor([prompt]), cache, logits_to_keep=len(prompt))[0]
        return torch.cat([prefill, *(llm.model(torch.tensor([[t]]), cache)[0] for t in more)])


def assert_c_step_follows_torch(llm: LLM, prompt: list[int], more: list[int], monkeypatch: pytest.MonkeyPatch) -> float:
    """`llm` (quantized projections) decodes in C; its torch step (c_decode off) over the same
    linears must give the same logits up to the order of float sums and the same greedy tokens.
    Returns the largest logit difference."""
    params = SamplingParams(max_new_tokens=len(more), ignore_eos=True)
    in_c, c_tokens = prefill_and_steps(llm, prompt, more), llm.generate(prompt, params).token_ids
    assert llm.model._step is not None
    with monkeypatch.context() as patch:
        patch.setattr(llm.model, "c_decode", False)
        in_torch, torch_tokens = prefill_and_steps(llm, prompt, more), llm.generate(prompt, params).token_ids
    difference = (in_c - in_torch).abs().max().item()
    assert difference < 1e-4
    assert c_tokens == torch_tokens
    return difference
