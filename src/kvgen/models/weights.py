"""Taking named weights out of a checkpoint, with an error that names what is missing."""

from __future__ import annotations

import torch
from torch import nn

from kvgen.errors import ModelLoadError


class WeightSource:
    """Hands out checkpoint tensors by Hugging Face name and remembers which were used."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self._tensors = tensors
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self._tensors

    def take(self, name: str) -> torch.Tensor:
        if name not in self._tensors:
            raise ModelLoadError(f"the checkpoint has no weight {name!r}; it is incomplete or for another architecture")
        self.used.add(name)
        return self._tensors[name]

    def take_optional(self, name: str) -> torch.Tensor | None:
        return self.take(name) if name in self._tensors else None


def frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """An nn.Linear that owns the given weight [out, in] (no random init, no copy)."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = frozen(weight)
    if bias is not None:
        layer.bias = frozen(bias)
    return layer


def fused_linear(weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None) -> nn.Linear:
    """One matmul for several projections of the same input (QKV, gate/up): fewer, larger GEMMs."""
    bias = None
    if biases is not None and any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else torch.zeros(w.shape[0], dtype=w.dtype) for w, b in zip(weights, biases)])
    return linear(torch.cat(weights, dim=0), bias)
