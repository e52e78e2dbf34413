"""The reference for sampling tests: every step's logits recomputed from scratch (no cache reuse)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from kvgen import LLM


def logits_from_scratch(llm: LLM, ids: Sequence[int]) -> torch.Tensor:
    """Last-position logits [V] of one full forward over `ids` in a fresh cache."""
    cache = llm.generator.new_cache(len(ids))
    with torch.inference_mode():
        return llm.model(torch.tensor([list(ids)]), cache)[0, -1].clone()


def greedy_from_scratch(
    llm: LLM, prompt_ids: Sequence[int], num_tokens: int,
    transform: Callable[[torch.Tensor, list[int]], torch.Tensor] = lambda logits, generated: logits,
) -> list[int]:  # fmt: skip
    """Greedy tokens where each step's logits (given the tokens generated so far) pass `transform`."""
    generated: list[int] = []
    for _ in range(num_tokens):
        logits = transform(logits_from_scratch(llm, list(prompt_ids) + generated), generated)
        generated.append(int(torch.argmax(logits)))
    return generated
