"""HalfLinear: nn.Linear's job over 16-bit float weights (F16 or BF16) kept as the checkpoint has them.

Few rows (decode, verifies, small batches) run the C kernel over fp32 activations, each weight
widened to fp32 before it is multiplied, so the output differs from an fp32 nn.Linear over the same
values only in the order of its sums (kernels/half_linear.c). The weights take half the memory of an
fp32 copy, and a decode step, which reads every weight once, reads half the bytes.

Many rows (a prompt) are bound by their multiplies, not the bytes. Where the kernels are built with
AVX512-BF16 (kernels/bf16_gemm.c) they run bf16 dot products: the activations rounded to bf16, the
weights exact (an F16 weight as a bf16 part and the rest), sums and outputs fp32, each row's outputs
independent of the other rows; ~3.5x (BF16) and ~2.4x (F16) the widened fp32 GEMM. Elsewhere with
AVX-512 the C kernel, which widens each weight once for two rows, takes every row count (prompts
then run the C rows step, models/fast_decode.py); with AVX2 the weight is widened a slice at a time
into a buffer for torch's fp32 GEMM. KVGEN_PREFILL_GEMM (models/quantized_linear.py) picks the
many-row path: bf16 (that kernel; without it oneDNN's bf16 GEMM, which rounds F16 weights and the
outputs to bf16 too), fp32 (the widened GEMM) or int8 (no GEMM: the C kernel at every row count, as
for quantized weights).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvgen.kernels import load
from kvgen.kv import huge_pages
from kvgen.models.quantized_linear import BF16_GEMM_ROWS_THRESHOLD, NEVER, PrefillPath, QuantizedLinear, prefill_path

HALF_DTYPES = (torch.float16, torch.bfloat16)
# From about this many rows on, widening the weight and a BLAS GEMM beat the C kernel one row at a
# time (AVX2 builds; one SmolLM2 layer's linears on 2 Zen 4 cores: 16 rows 0.90 ms in C against 1.01,
# 48 rows 2.62 against 2.46, 128 rows 7.0 against 5.3). Two rows at a time (AVX-512) the C kernel
# wins at every count (128 rows: 2.5 / 3.3 ms for BF16 / F16 against 5.2 / 4.9).
GEMM_ROWS_THRESHOLD = 32
# From this many rows on, the bf16 kernel beats the C kernel (one SmolLM2 layer's linears on 2 Zen 4
# cores, BF16 / F16 weights: 4 rows 0.12 / 0.13 ms in C against 0.07 / 0.17, 8 rows 0.20 / 0.24
# against 0.09 / 0.23, 32 rows 0.64 / 0.85 against 0.29 / 0.59).
BF16_ROWS_THRESHOLD = 8
WIDENED_SLICE_BYTES = 1 << 20  # the fp32 slice of a weight widened at a time (Zen 4: 1 MB of L2 a core)

_scratch = threading.local()  # one fp32 buffer per thread for the widened slices


@dataclass(frozen=True)
class HalfWeight:
    """A checkpoint's matmul weight (or token embedding) that the 16bit mode keeps as the file's
    float16 / bfloat16 values [out, in]: `linear` makes it a HalfLinear. Read as floats elsewhere
    (`float()`, `shape`), as a float tensor would be."""

    values: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    @property
    def out_features(self) -> int:
        return self.values.shape[0]

    def float(self) -> torch.Tensor:
        return self.values.float()


def _widened_buffer(size: int) -> torch.Tensor:
    buffer = getattr(_scratch, "weights", None)
    if buffer is None or buffer.numel() < size:
        buffer = torch.empty(size, dtype=torch.float32)
        _scratch.weights = buffer
    return buffer[:size]


def bf16_gemm_built() -> bool:
    """Whether the kernels were built with AVX512-BF16's dot products (kernels/bf16_gemm.c): 16-bit
    weights' many-row path then defaults to them."""
    library = load()
    return library is not None and bool(library.kvgen_bf16_gemm_built())


def default_prefill() -> PrefillPath:
    """16-bit weights' many-row path where KVGEN_PREFILL_GEMM does not pick one: the bf16 kernel
    where built; else, where the C kernel runs rows two at a time (AVX-512), that kernel at every
    row count (and prompts through the C rows step); else the widened fp32 GEMM."""
    if bf16_gemm_built():
        return "bf16"
    library = load()
    return "int8" if library is not None and library.kvgen_half_row_pairs_built() else "fp32"


def has_half_linears(module: nn.Module) -> bool:
    """Whether some linear under `module` keeps 16-bit weights (the C rows steps then hold the
    activations as floats)."""
    return any(isinstance(m, HalfLinear) for m in module.modules())


def pair_interleaved(weight: torch.Tensor) -> torch.Tensor:
    """BF16 rows [n, k] in the kernels' layout: in each 16 weights, weight i and 8 + i side by side, so
    one load widens to two fp32 vectors in order with a shift and a mask (kernels/half_linear.c). A
    strided view; copying it lays the rows out."""
    n, k = weight.shape
    return weight.view(n, k // 16, 2, 8).transpose(-1, -2)


def row_major(stored: torch.Tensor) -> torch.Tensor:
    """pair_interleaved's rows (laid out) back in the checkpoint's order."""
    n, k = stored.shape
    return stored.view(n, k // 16, 8, 2).transpose(-1, -2).reshape(n, k)


def _on_huge_pages(weight: torch.Tensor, interleave: bool) -> torch.Tensor:
    """The weight copied onto transparent huge pages where the system gives them (as the quantized
    weights are: a decode step streams every weight once, and 4 KB pages cost a TLB miss each), BF16
    rows pair-interleaved in the same copy."""
    out = huge_pages.empty(tuple(weight.shape), weight.dtype)
    n, k = weight.shape
    if interleave:
        out.view(n, k // 16, 8, 2).copy_(pair_interleaved(weight))
    else:
        out.copy_(weight)
    return out


class HalfLinear(nn.Module):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if weight.dtype not in HALF_DTYPES or weight.dim() != 2:
            raise ValueError(f"HalfLinear takes a 2-D float16 or bfloat16 weight, got {weight.dtype} {tuple(weight.shape)}")
        library = load()
        assert library is not None, "HalfLinear needs the compiled kernels (kvgen.kernels.load())"
        bf16 = weight.dtype == torch.bfloat16
        self._linear = library.kvgen_linear_bf16 if bf16 else library.kvgen_linear_f16
        self._widen_pairs = library.kvgen_widen_bf16_pairs
        self.out_features, self.in_features = weight.shape
        # weight16: F16 rows as the checkpoint has them, BF16 rows pair-interleaved (`row_major` undoes it)
        self.register_buffer("weight16", _on_huge_pages(weight, bf16), persistent=False)
        self.bias = nn.Parameter(bias.float(), requires_grad=False) if bias is not None else None
        self._weight_ptr = self.weight16.data_ptr()
        self._bf16_kernel = library.kvgen_gemm_bf16_rows if bf16 else library.kvgen_gemm_f16_rows
        self._bf16_built = bf16_gemm_built()
        self.prefill = prefill_path(default=default_prefill())
        bf16_rows = BF16_ROWS_THRESHOLD if self._bf16_built else BF16_GEMM_ROWS_THRESHOLD
        self.gemm_rows = {"int8": NEVER, "bf16": bf16_rows}.get(self.prefill, GEMM_ROWS_THRESHOLD)

    @property
    def kind(self) -> str:
        return "f16" if self.weight16.dtype == torch.float16 else "bf16"

    @property
    def pair_interleaved(self) -> bool:
        return self.weight16.dtype == torch.bfloat16

    def dequantized(self) -> torch.Tensor:
        """The weight as a new fp32 [out, in] tensor in the checkpoint's order (QuantizedLinear's name)."""
        return (row_major(self.weight16) if self.pair_interleaved else self.weight16).float()

    def forward(self, x: torch.Tensor, row_invariant: bool = False) -> torch.Tensor:
        """x [..., in] -> [..., out]. row_invariant: the C kernel at any row count, whose output for a
        row does not depend on the other rows."""
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        m = rows.shape[0]
        if m >= self.gemm_rows and not row_invariant:
            y = self._bf16_gemm(rows) if self.prefill == "bf16" else self._widened_gemm(rows)
        else:
            y = torch.empty(m, self.out_features)
            self._linear(self._weight_ptr, rows.data_ptr(), y.data_ptr(), m, self.out_features, self.in_features)
        if self.bias is not None:
            y += self.bias
        y = y.view(*shape[:-1], self.out_features)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def _widened_gemm(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, in] @ W^T by torch's GEMM, W widened a slice of outputs at a time into a buffer
        that stays in cache: widening all of it first wrote and read back 4 bytes a weight through
        memory (SmolLM2's linears at 128 rows: 6.7 ms a layer widened whole, 5.3 in slices; 6.0 for
        an fp32 weight)."""
        n, k = self.out_features, self.in_features
        step = max(16, WIDENED_SLICE_BYTES // (4 * k) // 16 * 16)
        buffer = _widened_buffer(min(step, n) * k)
        out = torch.empty(n, rows.shape[0])  # W rows @ x^T: each slice's outputs are whole rows of it
        for first in range(0, n, step):
            end = min(n, first + step)
            piece = buffer[: (end - first) * k].view(end - first, k)
            if self.pair_interleaved:
                self._widen_pairs(self.weight16[first].data_ptr(), piece.data_ptr(), end - first, k)
            else:
                piece.copy_(self.weight16[first:end])
            torch.mm(piece, rows.t(), out=out[first:end])
        return out.t().contiguous()

    def _bf16_gemm(self, rows: torch.Tensor) -> torch.Tensor:
        """Activations rounded to bf16: the AVX512-BF16 kernel where built (fp32 sums and outputs,
        the weights exact), else torch's (oneDNN's) bf16 GEMM over the rows laid out as the weights
        are (F16 weights rounded to bf16; outputs in bf16)."""
        m = rows.shape[0]
        if self._bf16_built:
            y = torch.empty(m, self.out_features)
            failed = self._bf16_kernel(self._weight_ptr, rows.data_ptr(), y.data_ptr(), m, self.out_features, self.in_features)
            if failed:
                raise MemoryError(f"the bf16 kernel could not allocate scratch for {m} rows of {self.in_features} values")
            return y
        if self.pair_interleaved:  # a dot product's terms in any order: the rows in the weights' order
            return F.linear(pair_interleaved(rows).reshape(m, self.in_features).to(torch.bfloat16), self.weight16).float()
        return F.linear(rows.to(torch.bfloat16), self.weight16.to(torch.bfloat16)).float()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kind={self.kind}, {self.weight16.numel() * 2 / 2**20:.1f} MiB"


# The linears the C steps read (quantized blocks, 16-bit rows): each takes row_invariant, has a C kernel
# and becomes a decode.c qlinear.
C_STEP_LINEARS = (QuantizedLinear, HalfLinear)
