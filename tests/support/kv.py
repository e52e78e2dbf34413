"""Random keys and values for cache tests."""

from __future__ import annotations

import torch

from kvgen.kv import CacheSpec


def random_kv(spec: CacheSpec, seed: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [1, H_kv, length, D] drawn from a seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    shape = (1, spec.num_kv_heads, length, spec.head_dim)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
