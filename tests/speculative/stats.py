"""Pearson's chi-square goodness of fit, with critical values from a table (no scipy)."""

from __future__ import annotations

import torch

# Upper 0.1% points of the chi-square distribution by degrees of freedom (standard tables).
CHI2_CRITICAL_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124,
                       9: 27.877, 10: 29.588, 11: 31.264, 12: 32.909}  # fmt: skip


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """sum (observed - expected)^2 / expected over the bins; probs must sum to 1."""
    expected = probs.double() * counts.sum().double()
    assert bool((expected >= 5).all()), f"bins with fewer than 5 expected counts: {expected.tolist()}; merge them"
    return float(((counts.double() - expected) ** 2 / expected).sum())


def binned(probs: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `top` most likely tokens plus one bin for all others -> (token ids [top], bin probs [top+1])."""
    values, ids = torch.topk(probs, top)
    return ids, torch.cat([values, (1 - values.sum()).clamp(min=0)[None]])
