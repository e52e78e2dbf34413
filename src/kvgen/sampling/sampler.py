"""Turns the last position's logits into a token id under SamplingParams."""

from __future__ import annotations

import torch

from kvgen.sampling.params import SamplingParams


class Sampler:
    """One per request: it owns the request's random stream so a seed reproduces the same text."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """logits [V] -> token id."""
        if self.params.greedy:
            return int(torch.argmax(logits))
        probs = self.probabilities(logits)
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution sampling draws from: temperature, then top-k, then top-p; [V]."""
        p = self.params
        scores = logits.float() / p.temperature
        if p.top_k and p.top_k < scores.numel():
            kth = torch.topk(scores, p.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=True)
            sorted_probs = torch.softmax(sorted_scores, dim=-1)
            # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
            drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            scores = scores.scatter(0, order[drop], float("-inf"))
        return torch.softmax(scores, dim=-1)
