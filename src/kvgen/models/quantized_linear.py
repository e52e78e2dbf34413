"""QuantizedLinear: nn.Linear's job with weights kept in 4- or 8-bit blocks.

Few rows (decode, small batches): activations are quantized to int8 blocks and multiplied by the
blocks directly in C, reading the weights once per 4 rows. Many rows (prefill): the weight is
dequantized into a temporary fp32 matrix and MKL does the GEMM, since compute, not weight reads,
bounds that case.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from kvgen.kernels import load
from kvgen.kernels.formats import BLOCK_BYTES, QK, QuantizedWeight

# One per thread: within a forward pass one weight is used at a time; threads must not share it.
_scratch = threading.local()

# From this many rows on, dequantize + MKL fp32 GEMM beats the C kernel. Measured over SmolLM2's
# linears on 2 EPYC cores (AVX-512 machine, AVX2 kernel): 32 rows 265 vs 320 rows/s, 64 rows 341 vs 304.
GEMM_ROWS_THRESHOLD = 48
X8_BLOCK_BYTES = 8 + QK


class QuantizedLinear(nn.Module):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        library = load()
        assert library is not None, "QuantizedLinear needs the compiled kernels (kvgen.kernels.load())"
        self._linear = library.kvgen_linear_q4 if weight.kind == "q4" else library.kvgen_linear_q8
        self._dequantize = library.kvgen_dequantize_q4 if weight.kind == "q4" else library.kvgen_dequantize_q8
        self.kind = weight.kind
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.register_buffer("blocks", weight.blocks.contiguous(), persistent=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        # Per-call costs matter at ~120 calls per token: keep the pointers and a scratch buffer ready.
        self._blocks_ptr = self.blocks.data_ptr()
        self._scratch = torch.empty(0, dtype=torch.uint8)

    def dequantized(self, reuse_scratch: bool = False) -> torch.Tensor:
        """The weight as fp32 [out, in]. reuse_scratch: write into one buffer shared by every layer
        (valid until the next call), which spares prefill from faulting in fresh memory per matmul."""
        size = self.out_features * self.in_features
        if reuse_scratch:
            buffer = getattr(_scratch, "weights", None)
            if buffer is None or buffer.numel() < size:
                buffer = _scratch.weights = torch.empty(size)
            out = buffer[:size].view(self.out_features, self.in_features)
        else:
            out = torch.empty(self.out_features, self.in_features)
        self._dequantize(self.blocks.data_ptr(), out.data_ptr(), self.out_features, self.in_features)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)  # [M, K]
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        m = rows.shape[0]
        if m >= GEMM_ROWS_THRESHOLD:
            y = F.linear(rows, self.dequantized(reuse_scratch=True))
        else:
            needed = m * (self.in_features // QK) * X8_BLOCK_BYTES  # the C side writes m rows of blocks
            if self._scratch.numel() < needed:
                self._scratch = torch.empty(needed, dtype=torch.uint8)
            y = torch.empty(m, self.out_features)
            self._linear(self._blocks_ptr, rows.data_ptr(), self._scratch.data_ptr(), y.data_ptr(), m,
                         self.out_features, self.in_features)  # fmt: skip
        if self.bias is not None:
            y += self.bias
        y = y.view(*shape[:-1], self.out_features)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kind={self.kind}, {self.blocks.numel() / 2**20:.1f} MiB"


assert BLOCK_BYTES["q8"] == X8_BLOCK_BYTES  # activation blocks share the q8 layout size
