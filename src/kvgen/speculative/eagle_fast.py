"""The EAGLE head's decoder layer as one C call per position, for a quantized target.

The head's layer is a pre-norm Llama block (RMSNorm, grouped-query attention with RoPE, gated
MLP), so the C decode step that runs the target's blocks (kernels/decode.c, kvgen_decode_layers)
runs it too, over the head's own keys and values: the same 8-bit linears the torch path would call
one by one, but the norms, RoPE, attention and activations in the same call. In the torch path a
draft token was ~60 small tensor operations (~0.24 ms with the weights in cache); here it is the
input map, one C call, the residual and the draft-vocabulary projection.
"""

from __future__ import annotations

import torch

from kvgen.kernels import load
from kvgen.kernels.formats import QuantizedWeight, requantize
from kvgen.models.fast_decode import BlockStruct, qlinear_struct
from kvgen.models.quantized_linear import QuantizedLinear
from kvgen.speculative.eagle_head import RMS_EPS, EagleHead, HeadCache


class FastHeadWeights:
    """The head's linears requantized to 8 bits (q8s) in the block layout decode.c reads: q, k and v
    as one linear, gate and up as one. Built once per model and head file and shared read-only by
    every proposer: the C step reads the block linears' packed weights and writes only its own
    scratch."""

    def __init__(self, head: EagleHead):
        def q8(*names: str) -> QuantizedWeight:
            return requantize(torch.cat([getattr(head, name).weight for name in names]), "q8s")

        self.head = head
        self.fc = q8("fc")  # each proposer runs its own QuantizedLinear over it (the module's scratch)
        fused = (("q", "k", "v"), ("o",), ("gate", "up"), ("down",))  # decode.c's qkv, o, gate_up, down
        self.block_linears = [QuantizedLinear(q8(*names)) for names in fused]


class FastHeadCache(HeadCache):
    """HeadCache whose positions run through the C decode step. Each proposer has its own: the
    block's scratch buffers are written by every call."""

    def __init__(self, weights: FastHeadWeights, capacity: int = 256):
        super().__init__(weights.head, capacity)
        head = weights.head
        self.library = load()
        self.fc = QuantizedLinear(weights.fc)
        self._weights = weights  # the block linears the struct points into
        widths = (head.hidden_size, (head.heads + 2 * head.kv_heads) * head.head_dim, head.heads * head.head_dim,
                  2 * head.inner_size)  # fmt: skip
        self._scratch = [torch.zeros(width) for width in widths]
        block = BlockStruct(
            head.hidden_size, head.heads, head.kv_heads, head.head_dim, head.inner_size, RMS_EPS, head.head_dim**-0.5,
            0, 0, head.attn_norm.data_ptr(), None, head.mlp_norm.data_ptr(), None, None, None,
            *(qlinear_struct(linear) for linear in weights.block_linears), *(buffer.data_ptr() for buffer in self._scratch),
        )  # fmt: skip
        self._block = (BlockStruct * 1)(block)
        self._zero = torch.zeros(1, dtype=torch.int64)  # rope kind and window of the one layer

    def run(self, features: torch.Tensor, token_embeddings: torch.Tensor) -> torch.Tensor:
        """features, token_embeddings [n, H] at the next n positions -> predicted next features [n, H]."""
        head, n, start = self.head, features.shape[0], self.length
        self._reserve(start + n)
        x = self.fc(head.stream_input(features, token_embeddings))  # [n, H]
        assert x.is_contiguous()  # the C step updates each row in place
        k, v, capacity, dim = self.k, self.v, self.k.shape[1], head.head_dim
        for i in range(n):  # x[i] becomes the block's output, x + attention + MLP
            self.library.kvgen_decode_layers(
                self._block, 1, x[i].data_ptr(), self.rope[start + i].data_ptr(), self._zero.data_ptr(),
                self._zero.data_ptr(), k.data_ptr(), v.data_ptr(), 0, capacity * dim, dim, 0, 1, None, start + i,
                None, -1,
            )  # fmt: skip
        self.length = start + n
        return features + x
