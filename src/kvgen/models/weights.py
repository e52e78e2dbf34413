"""Taking named weights out of a checkpoint, with an error that names what is missing."""

from __future__ import annotations

import torch
from torch import nn

from kvgen.errors import ModelLoadError
from kvgen.kernels.formats import QuantizedWeight, concat_rows
from kvgen.models.embedding import BF16, F16, Q8_0, HalfRows, HeadRows, QuantizedEmbedding, QuantizedRows
from kvgen.models.half_linear import HalfLinear, HalfWeight

# QuantizedRows: a quantized file's token embedding; HalfWeight: the 16bit mode's matmul weights
Weight = torch.Tensor | QuantizedWeight | QuantizedRows | HalfWeight


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
        if isinstance(weight, HalfWeight):  # a 16bit checkpoint's table, where a family indexes floats
            return weight.float()
        assert isinstance(weight, torch.Tensor), f"{name} must be a float tensor, not quantized"
        return weight


def frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def linear(weight: Weight, bias: torch.Tensor | None = None) -> nn.Module:
    """An nn.Linear that owns the given weight [out, in] (no random init, no copy), a QuantizedLinear
    over quantized blocks, or a HalfLinear over float16 / bfloat16 weights (the 16bit mode)."""
    if isinstance(weight, QuantizedWeight):
        from kvgen.models.quantized_linear import QuantizedLinear

        return QuantizedLinear(weight, bias)
    if isinstance(weight, HalfWeight):
        return HalfLinear(weight.values, bias)
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = frozen(weight)
    if bias is not None:
        layer.bias = frozen(bias)
    return layer


def fused_linear(weights: list[Weight], biases: list[torch.Tensor | None] | None = None) -> nn.Module:
    """One matmul for several projections of the same input (QKV, gate/up): fewer, larger GEMMs."""
    rows = [w.shape[0] if isinstance(w, torch.Tensor) else w.out_features for w in weights]
    bias = None
    if biases is not None and any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else torch.zeros(n) for n, b in zip(rows, biases)])
    if all(isinstance(w, QuantizedWeight) for w in weights):
        return linear(concat_rows(weights), bias)  # type: ignore[arg-type]
    if any(isinstance(w, QuantizedWeight) for w in weights):
        raise AssertionError("cannot fuse quantized and float weights")
    if all(isinstance(w, HalfWeight) for w in weights) and len({w.values.dtype for w in weights}) == 1:  # type: ignore[union-attr]
        return linear(HalfWeight(torch.cat([w.values for w in weights], dim=0)), bias)  # type: ignore[union-attr]
    if any(isinstance(w, HalfWeight) for w in weights):  # 16-bit parts beside other floats: fused in fp32
        weights = [w.float() for w in weights]  # type: ignore[union-attr]
    return linear(torch.cat(weights, dim=0), bias)  # type: ignore[arg-type]


def _tied_half_rows(head: nn.Module, tied: bool, table_dtype: torch.dtype | None, shape: tuple[int, int],
                    dtype: torch.dtype) -> HalfRows | None:  # fmt: skip
    """A tied 16-bit table's rows read from its HalfLinear head, which holds the same values (None
    where the head is not that)."""
    if tied and isinstance(head, HalfLinear) and head.weight16.dtype == table_dtype and tuple(head.weight16.shape) == shape:
        return HalfRows(head.weight16, dtype, head.pair_interleaved)
    return None


def token_embedding(weight: torch.Tensor | QuantizedRows | HalfWeight, head: nn.Module, tied: bool) -> nn.Parameter | QuantizedEmbedding:
    """A model's token embedding: a float table as it is; a quantized file's rows read from the
    head where a tied head holds them unchanged (Q8_0 as `q8s`, F16 / BF16 in a HalfLinear), else
    copied out of the file; a 16-bit table looked up as it is, from the head where that holds it."""
    if isinstance(weight, torch.Tensor):
        return frozen(weight)
    if isinstance(weight, HalfWeight):
        rows = _tied_half_rows(head, tied, weight.values.dtype, tuple(weight.shape), torch.float32)
        return QuantizedEmbedding(rows if rows is not None else HalfRows(weight.values, torch.float32))
    half_type = {F16: torch.float16, BF16: torch.bfloat16}.get(weight.type_id)
    rows = _tied_half_rows(head, tied, half_type, (weight.num_embeddings, weight.embedding_dim), weight.dtype)
    if rows is not None:
        return QuantizedEmbedding(rows)
    in_head = (tied and weight.type_id == Q8_0 and getattr(head, "kind", None) == "q8s"
               and (head.out_features, head.in_features) == (weight.num_embeddings, weight.embedding_dim))  # fmt: skip
    return QuantizedEmbedding(HeadRows(head, weight.dtype) if in_head else weight.owned())
