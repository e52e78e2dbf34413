"""Which weights kvgen keeps quantized, and in which kernel format.

  fp32  every weight dequantized to the compute dtype (exact reference behaviour)
  16bit matmul weights stored as F16 or BF16 (a float GGUF, a half-precision HF folder) kept so,
        widened to fp32 as they are multiplied (models/half_linear.py): the fp32 mode's values at
        half its memory; other weights fp32
  int8  matmul weights in 8-bit blocks: exact for Q4_0/Q4_1/Q8_0/Q5_0/Q5_1/Q3_K/Q4_K/Q5_K/IQ4 files,
        rounded otherwise (Q6_K, Q2_K, floats); symmetric q8s blocks with f16 scales where the
        source has no offsets, q8 otherwise
  q4    matmul weights as the file has them where the kernels can (4-bit Q4_0/Q4_1, Q4_K, IQ4,
        5-bit Q5_x, Q6_K super-blocks and Q3_K in them, 8-bit Q8_0); Q2_K and float weights rounded
        to 4-bit
  auto  q4 for a quantized GGUF file when the kernels compiled, 16bit for F16 / BF16 matmul
        weights (fp32 compute), fp32 otherwise
"""

from __future__ import annotations

import warnings
from typing import Literal

import numpy as np
import torch

from kvgen.kernels.formats import EXACT_SOURCES, QK, Kind, QuantizedWeight, from_gguf_blocks, requantize

WeightMode = Literal["auto", "fp32", "16bit", "int8", "q4"]
ResolvedMode = Literal["fp32", "16bit", "int8", "q4"]
WEIGHT_MODES = ("auto", "fp32", "16bit", "int8", "q4")
_FOUR_BIT_OR_LESS = {"Q2_K", "Q4_K", "F32", "F16", "BF16"}


def check_mode(mode: str) -> WeightMode:
    if mode not in WEIGHT_MODES:
        raise ValueError(f"unknown weights mode {mode!r}; choose one of {', '.join(WEIGHT_MODES)}")
    return mode  # type: ignore[return-value]


def resolve_mode(mode: WeightMode, file_is_quantized: bool, half_weights: bool = False) -> ResolvedMode:
    """`auto` -> q4 for quantized files, 16bit where the matmul weights are F16 / BF16 (half_weights:
    the loader can keep them so), if the kernels are usable; a mode needing kernels falls back."""
    from kvgen.kernels import build, load

    if mode == "fp32":
        return "fp32"
    if mode == "16bit" and file_is_quantized:
        raise ValueError("--weights 16bit keeps a checkpoint's F16 / BF16 weights as they are, and this checkpoint's "
                         "weights are quantized: use --weights auto, q4, int8 or fp32")  # fmt: skip
    if mode == "16bit" and not half_weights:
        raise ValueError("--weights 16bit keeps F16 / BF16 matmul weights as they are, and this checkpoint has none that "
                         "kvgen can keep so (F32 weights, a compute dtype other than float32, or a family whose weights "
                         "are transformed at load): use --weights fp32, or int8 / q4 to quantize them")  # fmt: skip
    if load() is None:
        if mode != "auto":
            warnings.warn(f"--weights {mode} needs kvgen's C kernels, which could not be built "
                          f"({build.last_error}); using fp32 weights instead", stacklevel=3)  # fmt: skip
        return "fp32"
    if mode == "auto":
        return "q4" if file_is_quantized else "16bit" if half_weights else "fp32"
    return mode


def quantizes(mode: ResolvedMode) -> bool:
    """Whether matmul weights go into the kernels' blocks (int8, q4)."""
    return mode in ("int8", "q4")


# The token embedding's name, which a tied model's head reads: decoders' and Mamba's (backbone).
EMBEDDING_NAMES = ("model.embed_tokens.weight", "backbone.embeddings.weight")


def is_matmul_weight(hf_name: str) -> bool:
    return hf_name.endswith(("_proj.weight", "_proj_with_mqa.weight")) or hf_name == "lm_head.weight"  # the latter: DeepSeek's kv_a


def quantizable(shape: tuple[int, ...]) -> bool:
    return len(shape) == 2 and shape[-1] % QK == 0


def target_kind(mode: Literal["int8", "q4"], source_type: str) -> Kind:
    exact = EXACT_SOURCES.get(source_type)
    if mode == "int8":
        if exact == "iq4":  # the levels as int8: IQ4_NL's f16 scale fits q8s, IQ4_XS's needs q8's f32
            return "q8s" if source_type == "IQ4_NL" else "q8"
        if source_type == "Q3_K":
            return "q8"  # its integer products with an offset: exact (formats._q6k_eight_bit)
        if exact == "q6k":
            return "q8s"  # one scale per 32 weights, Q6_K two: rounded
        return "q8" if exact in ("q4", "q4h", "q8", "q4k", "q5m") else "q8s"  # sources with offsets keep them in q8
    if exact is not None:
        return exact
    return "q4" if source_type in _FOUR_BIT_OR_LESS else "q8s"


def quantize_gguf_rows(type_name: str, raw_rows: np.ndarray, dequantized: np.ndarray | None,
                       mode: Literal["int8", "q4"]) -> QuantizedWeight:  # fmt: skip
    """GGUF tensor rows -> kernel format; `dequantized` (float rows) is needed for non-exact types."""
    kind = target_kind(mode, type_name)
    if type_name in EXACT_SOURCES:
        return from_gguf_blocks(type_name, raw_rows, kind)
    assert dequantized is not None, f"{type_name} must be dequantized before requantizing"
    rows = np.array(dequantized, dtype=np.float32, order="C", copy=not dequantized.flags.writeable)  # F32 rows: a read-only map
    return requantize(torch.from_numpy(rows), kind)


def quantize_float(weight: torch.Tensor, mode: Literal["int8", "q4"]) -> QuantizedWeight:
    # Float weights under `--weights int8` keep the q8 blocks (f32 scale): with q8s, a random tiny
    # Qwen3's C decode step and torch path parted by one int8 activation rounding from the 17th
    # token on (tests/parity/test_tiny_families.py), which q8 does not show; not yet understood.
    return requantize(weight, "q8" if mode == "int8" else "q4")
