"""Measuring output quality: per-token log-probabilities and perplexity over a text.

Used to state how much a lossy path (quantized weights, later quantized KV) changes the model, as
the change in perplexity and the KL divergence against the exact path on the same tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvgen.models.base import DecoderLM


@dataclass
class Scores:
    logprobs: torch.Tensor  # [T-1] log p(token t+1 | tokens <= t)
    distributions: torch.Tensor | None  # [T-1, V] log-softmax rows, when kept for KL comparisons

    @property
    def perplexity(self) -> float:
        return math.exp(-self.logprobs.mean().item())


@torch.inference_mode()
def score(model: DecoderLM, cache_factory, ids: list[int], chunk_size: int, keep_distributions: bool = False) -> Scores:
    """Feed `ids` through the model `chunk_size` tokens at a time over one cache.

    chunk_size 1 is token-by-token decoding. On quantized weights over an fp32 cache every chunk
    runs the C step (the same bits at any chunk size); elsewhere chunks run the torch path.
    """
    cache = cache_factory(len(ids))
    rows: list[torch.Tensor] = []
    for start in range(0, len(ids) - 1, chunk_size):
        chunk = ids[start : min(start + chunk_size, len(ids) - 1)]
        logits = model(torch.tensor([chunk]), cache, logits_to_keep=len(chunk))[0]  # [S, V]
        rows.append(torch.log_softmax(logits.float(), dim=-1))
    distributions = torch.cat(rows)  # [T-1, V]
    targets = torch.tensor(ids[1:])
    logprobs = distributions.gather(1, targets[:, None])[:, 0]
    return Scores(logprobs, distributions if keep_distributions else None)


def kl_divergence(reference: Scores, other: Scores) -> float:
    """Mean KL(reference || other) per position, in nats."""
    assert reference.distributions is not None and other.distributions is not None
    p = reference.distributions.exp()
    # KL is >= 0; float rounding can leave a true zero at -1e-9.
    return max(0.0, (p * (reference.distributions - other.distributions)).sum(-1).mean().item())


def top1_agreement(reference: Scores, other: Scores) -> float:
    assert reference.distributions is not None and other.distributions is not None
    return (reference.distributions.argmax(-1) == other.distributions.argmax(-1)).float().mean().item()
