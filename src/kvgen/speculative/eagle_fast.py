"""The EAGLE head's decoder layer as one C call per position, for a quantized target.

The head's layer is a pre-norm Llama block (RMSNorm, grouped-query attention with RoPE, gated
MLP), so the C decode step that runs the target's blocks (kernels/decode.c, kvgen_decode_layers)
runs it too, over the head's own keys and values: the same 8-bit linears the torch path would call
one by one, but the norms, RoPE, attention and activations in the same call. In the torch path a
draft token was ~60 small tensor operations (~0.24 ms with the weights in cache). Here a position
is one call (kernels/eagle_step.c: the input map's norms and linear, the block, the residual), a
run of positions one call too (the block by the rows step: the head's weights read once), and a
draft token's logits one more (the target's final norm and the draft-vocabulary rows).
"""

from __future__ import annotations

import ctypes

import torch

from kvgen.kernels import load
from kvgen.kernels.formats import QuantizedWeight, requantize
from kvgen.models.fast_decode import BlockStruct, qlinear_struct, rows_scratch
from kvgen.models.layers import RMSNorm
from kvgen.models.quantized_linear import X8_BLOCK_BYTES, QuantizedLinear
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
        self.fc = QuantizedLinear(q8("fc"))  # the C position call quantizes its input into the caller's scratch
        # The input map's two norm weights side by side, as kvgen_eagle_position reads them.
        self.scales = torch.cat([head.feature_scale.detach(), head.token_scale.detach()]).float().contiguous()
        fused = (("q", "k", "v"), ("o",), ("gate", "up"), ("down",))  # decode.c's qkv, o, gate_up, down
        self.block_linears = [QuantizedLinear(q8(*names)) for names in fused]


class FastHeadCache(HeadCache):
    """HeadCache whose positions run through the C decode step. Each proposer has its own: the
    block's scratch buffers are written by every call."""

    def __init__(self, weights: FastHeadWeights, capacity: int = 256):
        super().__init__(weights.head, capacity)
        head = weights.head
        self.library = load()
        self._weights = weights  # the linears the structs point into
        self._fc = qlinear_struct(weights.fc)
        widths = (head.hidden_size, (head.heads + 2 * head.kv_heads) * head.head_dim, head.heads * head.head_dim,
                  2 * head.inner_size)  # fmt: skip
        self._scratch = [torch.zeros(width) for width in widths]
        block = BlockStruct(
            head.hidden_size, head.heads, head.kv_heads, head.head_dim, head.inner_size, RMS_EPS, head.head_dim**-0.5,
            0.0, 0, head.head_dim, 0, head.attn_norm.data_ptr(), None, head.mlp_norm.data_ptr(), None, None, None,
            *(qlinear_struct(linear) for linear in weights.block_linears), *(buffer.data_ptr() for buffer in self._scratch),
        )  # fmt: skip
        self._block = (BlockStruct * 1)(block)
        self._zero = torch.zeros(1, dtype=torch.int64)  # rope kind and window of the one layer
        self._rows = 0  # the rows the scratch below holds
        self._grow(1)

    def _grow(self, rows: int) -> None:
        """Scratch for `rows` positions a call: the input map's normed inputs and their int8 blocks,
        and the rows step's buffers at the head's widths."""
        if rows <= self._rows:
            return
        head, rows = self.head, max(rows, 2 * self._rows)
        self._pairs = torch.empty(rows * 2 * head.hidden_size)
        self._xq = torch.empty(rows * 2 * head.hidden_size // 32 * X8_BLOCK_BYTES, dtype=torch.uint8)
        self._rows_buffers, self._rows_scratch = rows_scratch(
            rows, head.hidden_size, head.heads, head.kv_heads, head.head_dim, head.inner_size
        )
        self._tables = torch.zeros(rows, dtype=torch.int64)  # the one buffer's block, for each row
        self._rows = rows

    def run(self, features: torch.Tensor, token_embeddings: torch.Tensor) -> torch.Tensor:
        """features, token_embeddings [n, H] at the next n positions -> predicted next features [n, H].
        One C call: one position alone (kvgen_eagle_position), or the n together
        (kvgen_eagle_positions, each row the bits it gets alone)."""
        n, start = features.shape[0], self.length
        self._reserve(start + n)
        self._grow(n)
        k, v, capacity, dim = self.k, self.v, self.k.shape[1], self.head.head_dim
        features, token_embeddings = features.contiguous(), token_embeddings.contiguous()
        out = torch.empty_like(features)
        common = (self._block, ctypes.addressof(self._fc), self._weights.scales.data_ptr(), RMS_EPS, features.data_ptr(),
                  token_embeddings.data_ptr())  # fmt: skip
        if n == 1:
            self.library.kvgen_eagle_position(
                *common, self._pairs.data_ptr(), self._xq.data_ptr(), self.rope[start].data_ptr(), self._zero.data_ptr(),
                k.data_ptr(), v.data_ptr(), capacity * dim, dim, start, out.data_ptr(),
            )  # fmt: skip
        else:
            positions = torch.arange(start, start + n)
            self.library.kvgen_eagle_positions(
                *common, n, self._pairs.data_ptr(), self._xq.data_ptr(), self.rope[start : start + n].data_ptr(),
                self._zero.data_ptr(), k.data_ptr(), v.data_ptr(), capacity * dim, dim, start, self._tables.data_ptr(),
                positions.data_ptr(), ctypes.byref(self._rows_scratch), out.data_ptr(),
            )  # fmt: skip
        self.length = start + n
        return out


class FastDraftLogits:
    """A predicted feature's draft-vocabulary logits in one C call (kvgen_eagle_logits): the target's
    final norm, then the draft rows of its output head (8-bit blocks). Per proposer: the call
    writes its own scratch."""

    def __init__(self, norm: RMSNorm, project: QuantizedLinear):
        self.library = load()
        self.weight, self.eps, self.project = norm.weight.float().contiguous(), float(norm.eps), project
        self._project = qlinear_struct(project)
        self._normed = torch.empty(project.in_features)
        self._xq = torch.empty(project.in_features // 32 * X8_BLOCK_BYTES, dtype=torch.uint8)

    @staticmethod
    def build(norm: torch.nn.Module, project: torch.nn.Module) -> "FastDraftLogits | None":
        """The call for a quantized target's draft rows (None: an fp32 target's, which run in torch)."""
        if isinstance(norm, RMSNorm) and isinstance(project, QuantizedLinear) and project.kind in ("q8", "q8s"):
            return FastDraftLogits(norm, project)
        return None

    def __call__(self, feature: torch.Tensor) -> torch.Tensor:
        """feature [H] -> logits [N]."""
        feature = feature.contiguous()
        logits = torch.empty(self.project.out_features)
        self.library.kvgen_eagle_logits(
            feature.data_ptr(), self.weight.data_ptr(), self.eps, self._normed.data_ptr(),
            ctypes.addressof(self._project), self._xq.data_ptr(), logits.data_ptr(),
        )  # fmt: skip
        return logits
