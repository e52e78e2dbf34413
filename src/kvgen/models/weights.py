"""Taking named weights out of a checkpoint, with an error that names what is missing."""

from __future__ import annotations

import torch
from torch import nn

from kvgen.errors import ModelLoadError
from kvgen.kernels.formats import QuantizedWeight, concat_rows
from kvgen.models.embedding import Q8_0, HeadRows, QuantizedEmbedding, QuantizedRows

Weight = torch.Tensor | QuantizedWeight | QuantizedRows  # the last: a quantized file's token embedding


class WeightSource:
    """Hands out checkpoint tensors by Hugging Face name and remembers which were used."""

    def __init__(self, tensors: dict[str, Weight]):
        self._tensors = tensors
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self._tensors

    def take(self, name: str) -> Weight:
        if name not in self._tensors:
            raise ModelLoadError(f"the checkpoint has no weight {name!r}; it is incomplete or for another architecture")
        self.used.add(name)
        return self._tensors[name]

    def take_tensor(self, name: str) -> torch.Tensor:
        """A weight that must be a float tensor (norms, embeddings, biases); a quantized embedding
        is dequantized whole (families that index the float table)."""
        weight = self.take(name)
        if isinstance(weight, QuantizedRows):
            return weight.dequantized()
        assert isinstance(weight, torch.Tensor), f"{name} must be a float tensor, not quantized"
        return weight


def frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def linear(weight: Weight, bias: torch.Tensor | None = None) -> nn.Module:
    """An nn.Linear that owns the given weight [out, in] (no random init, no copy), or a
    QuantizedLinear over quantized blocks."""
    if isinstance(weight, QuantizedWeight):
        from kvgen.models.quantized_linear import QuantizedLinear

        return QuantizedLinear(weight, bias)
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = frozen(weight)
    if bias is not None:
        layer.bias = frozen(bias)
    return layer


def fused_linear(weights: list[Weight], biases: list[torch.Tensor | None] | None = None) -> nn.Module:
    """One matmul for several projections of the same input (QKV, gate/up): fewer, larger GEMMs."""
    rows = [w.out_features if isinstance(w, QuantizedWeight) else w.shape[0] for w in weights]
    bias = None
    if biases is not None and any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else torch.zeros(n) for n, b in zip(rows, biases)])
    if all(isinstance(w, QuantizedWeight) for w in weights):
        return linear(concat_rows(weights), bias)  # type: ignore[arg-type]
    if any(isinstance(w, QuantizedWeight) for w in weights):
        raise AssertionError("cannot fuse quantized and float weights")
    return linear(torch.cat(weights, dim=0), bias)  # type: ignore[arg-type]


def token_embedding(weight: torch.Tensor | QuantizedRows, head: nn.Module, tied: bool) -> nn.Parameter | QuantizedEmbedding:
    """A model's token embedding: a float table as it is; a quantized file's rows read from the
    head where a tied head holds them unchanged (Q8_0 as `q8s`), else copied out of the file."""
    if isinstance(weight, torch.Tensor):
        return frozen(weight)
    in_head = (tied and weight.type_id == Q8_0 and getattr(head, "kind", None) == "q8s"
               and (head.out_features, head.in_features) == (weight.num_embeddings, weight.embedding_dim))  # fmt: skip
    return QuantizedEmbedding(HeadRows(head, weight.dtype) if in_head else weight.owned())
