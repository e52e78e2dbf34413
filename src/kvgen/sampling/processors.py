"""Logits processors: each rewrites one step's logits [V] in place before the token is chosen.

The Sampler builds only the processors a request's parameters turn on, so a plain greedy request runs
none and costs one argmax.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from kvgen.sampling.grammar import TokenConstraint


class LogitsProcessor(Protocol):
    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] -> processed logits [V] (may modify the input)."""
        ...

    def observe(self, token_id: int) -> None:
        """The token chosen at this step (processors with per-request state update it)."""
        ...


class PenaltyProcessor:
    """vLLM / OpenAI penalties. repetition_penalty covers prompt and output tokens; presence and
    frequency penalties only the output (a token's count in what was generated so far)."""

    def __init__(self, repetition: float, presence: float, frequency: float, prompt_ids: Sequence[int], vocab_size: int):
        self.repetition, self.presence, self.frequency = repetition, presence, frequency
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)  # in the prompt or the output
        if prompt_ids:
            self.seen[torch.tensor(list(prompt_ids))] = True
        self.counts = torch.zeros(vocab_size, dtype=torch.float32)  # occurrences in the output

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.repetition != 1.0:
            penalized = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
            logits = torch.where(self.seen, penalized, logits)
        if self.frequency:
            logits = logits - self.frequency * self.counts
        if self.presence:
            logits = logits - self.presence * (self.counts > 0).float()
        return logits

    def observe(self, token_id: int) -> None:
        self.seen[token_id] = True
        self.counts[token_id] += 1


class LogitBiasProcessor:
    """Adds a fixed bias per token id (-inf bans the token)."""

    def __init__(self, bias: dict[int, float]):
        self.ids = torch.tensor(list(bias), dtype=torch.int64)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.index_add_(0, self.ids, self.values.to(logits.dtype))

    def observe(self, token_id: int) -> None:
        pass


class MinTokensProcessor:
    """Bans the ids that would end generation (EOS, stop_token_ids) until min_new_tokens are out."""

    def __init__(self, min_new_tokens: int, stop_ids: Sequence[int]):
        self.remaining = min_new_tokens
        self.stop_ids = torch.tensor(sorted(set(stop_ids)), dtype=torch.int64)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.remaining > 0 and self.stop_ids.numel():
            logits.index_fill_(0, self.stop_ids, float("-inf"))
        return logits

    def observe(self, token_id: int) -> None:
        self.remaining -= 1


class GrammarProcessor:
    """Masks every token the constraint (a grammar) does not allow next, and feeds it the chosen token."""

    def __init__(self, constraint: TokenConstraint):
        self.constraint = constraint

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.masked_fill_(~self.constraint.allowed_mask(logits.shape[-1]), float("-inf"))

    def observe(self, token_id: int) -> None:
        if not self.constraint.advance(token_id):
            raise RuntimeError(f"the grammar rejected token {token_id} it had allowed")
        prefetch = getattr(self.constraint, "prefetch", None)  # GrammarConstraint: next mask while the model runs
        if prefetch is not None and not self.constraint.is_finished():
            prefetch()
