"""QuantizedLinear: nn.Linear's job with weights kept in 4- or 8-bit blocks.

Activations are quantized to int8 blocks and multiplied by the weight's integers in C. Weights
are repacked at load, eight rows interleaved (kernels/interleaved.c), so that one kernel serves
every row count: a row's output has the same bits whether it is decoded alone, batched, verified
or prefilled, and on CPUs without native bf16 that int8 kernel also beats a dequantize + fp32 BLAS
GEMM on prefill (an int8 multiply-add does 4x the work of an fp32 FMA per instruction).

The C kernel is also the many-row path by default on CPUs with native bf16: on 2 Zen 4 cores
(AVX-512 VNNI + BF16) it prefilled SmolLM2 at 1,384 tok/s (128-token prompt) and 1,205 (512) against
643 and 892 for dequantizing to bf16 + oneDNN's bf16 GEMM, and Gemma 3 at 995 / 1,063 against
468 / 807; and one kernel at every row count keeps a prompt row's bits the same however its prompt
is chunked through the linears. KVGEN_PREFILL_GEMM=int8|fp32|bf16 overrides the many-row choice
(bf16 rounds activations and outputs to 8 significant bits, as coarse as the int8 blocks).
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from kvgen.kernels import load
from kvgen.kernels.formats import BLOCK_BYTES, QK, X8_GROUP_BYTES, QuantizedWeight
from kvgen.kv import huge_pages

# One per thread: within a forward pass one weight is used at a time; threads must not share it.
_scratch = threading.local()

# From this many rows on, dequantize + GEMM beat the row-major C kernels. Measured over SmolLM2's
# linears on 2 EPYC cores (AVX-512 machine, the row-major kernel that 4-bit weights used before
# q4x8): fp32 (MKL) 32 rows 265 vs 320 rows/s, 64 rows 341 vs 304; bf16 (oneDNN) 16 rows 368 vs
# 405, 24 rows 378 vs 312, 32 rows 548 vs 307.
GEMM_ROWS_THRESHOLD = 48
BF16_GEMM_ROWS_THRESHOLD = 24
X8_BLOCK_BYTES = 8 + QK
INTERLEAVED_ROWS = 8


PrefillPath = Literal["int8", "fp32", "bf16"]
NEVER = sys.maxsize


def prefill_path(default: PrefillPath = "int8") -> PrefillPath:
    """How many rows are multiplied: KVGEN_PREFILL_GEMM, else `default` (quantized weights: the int8
    C kernel; 16-bit ones: half_linear.default_prefill())."""
    choice = os.environ.get("KVGEN_PREFILL_GEMM", "auto")
    if choice not in ("auto", "int8", "fp32", "bf16"):
        raise ValueError(f"KVGEN_PREFILL_GEMM must be auto, int8, fp32 or bf16, got {choice!r}")
    if choice == "auto":
        return default
    return choice  # type: ignore[return-value]


def repack_x8(weight: QuantizedWeight) -> torch.Tensor:
    """Row-major blocks -> the kernels' layout of 8 interleaved rows (rows padded to a multiple of 8),
    on transparent huge pages where the system gives them: a decode step streams every weight once
    from DRAM, and on 4 KB pages each page is a TLB miss and a fresh start for the hardware
    prefetchers (batch-1 decode of Gemma 3 270M on Zen 4: 1.03-1.17x with two threads, with the
    machine's memory bandwidth of the time, 1.25x with one; benchmarks/weight_pages_ab.py)."""
    library = load()
    assert library is not None
    groups = -(-weight.out_features // INTERLEAVED_ROWS)
    group_bytes = X8_GROUP_BYTES[weight.kind]  # 8 rows' scales (and offsets), then their integers
    out = huge_pages.packed(groups * (weight.in_features // QK) * group_bytes)  # untouched until the repack
    repack = getattr(library, f"kvgen_repack_{weight.kind}x8")
    repack(weight.blocks.contiguous().data_ptr(), out.data_ptr(), weight.out_features, weight.in_features)
    return out


class QuantizedLinear(nn.Module):
    def __init__(self, weight: QuantizedWeight, bias: torch.Tensor | None = None):
        super().__init__()
        library = load()
        assert library is not None, "QuantizedLinear needs the compiled kernels (kvgen.kernels.load())"
        kind = weight.kind
        self._linear = getattr(library, f"kvgen_linear_{kind}x8")
        self._dequantize = {
            torch.float32: getattr(library, f"kvgen_dequantize_{kind}x8"),
            torch.bfloat16: getattr(library, f"kvgen_dequantize_{kind}x8_bf16"),
        }
        self.prefill = prefill_path()  # the many-row path; few rows always run the int8 C kernel
        self.kind = kind
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.register_buffer("blocks", repack_x8(weight), persistent=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        # Per-call costs matter at ~120 calls per token: keep the pointers and a scratch buffer ready.
        self._blocks_ptr = self.blocks.data_ptr()
        self._scratch = torch.empty(0, dtype=torch.uint8)

    @property
    def gemm_dtype(self) -> torch.dtype:
        """The dtype of the dequantized GEMM, where one runs."""
        return torch.bfloat16 if self.prefill == "bf16" else torch.float32

    @property
    def gemm_rows(self) -> int:
        """From this many rows on, forward dequantizes and runs a GEMM in `gemm_dtype` (NEVER: the
        int8 C kernel takes every row count)."""
        if self.prefill == "bf16":
            return BF16_GEMM_ROWS_THRESHOLD
        return NEVER if self.prefill == "int8" else GEMM_ROWS_THRESHOLD

    def dequantized(self, reuse_scratch: bool = False, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as [out, in] fp32 (or bf16). reuse_scratch: write into one buffer per dtype
        shared by every layer (valid until the next call), which spares prefill from faulting in
        fresh memory per matmul."""
        size = self.out_features * self.in_features
        if reuse_scratch:
            name = f"weights_{dtype}"
            buffer = getattr(_scratch, name, None)
            if buffer is None or buffer.numel() < size:
                buffer = torch.empty(size, dtype=dtype)
                setattr(_scratch, name, buffer)
            out = buffer[:size].view(self.out_features, self.in_features)
        else:
            out = torch.empty(self.out_features, self.in_features, dtype=dtype)
        self._dequantize[dtype](self.blocks.data_ptr(), out.data_ptr(), self.out_features, self.in_features)
        return out

    def forward(self, x: torch.Tensor, row_invariant: bool = False) -> torch.Tensor:
        """x [..., in] -> [..., out]. row_invariant: the C kernel at any row count, whose output for
        a row does not depend on the other rows (batch-invariant decodes), never the GEMM."""
        shape = x.shape
        rows = x.reshape(-1, self.in_features)  # [M, K]
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        m = rows.shape[0]
        if m >= self.gemm_rows and not row_invariant:
            weight = self.dequantized(reuse_scratch=True, dtype=self.gemm_dtype)
            y = F.linear(rows.to(weight.dtype), weight).float()
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
