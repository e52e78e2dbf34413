"""Quantized weight-only matmul kernels (C, compiled for the host at first use)."""

from kvgen.kernels.build import amx_tiles, load
from kvgen.kernels.formats import QuantizedWeight, concat_rows, from_gguf_blocks, requantize

__all__ = ["QuantizedWeight", "amx_tiles", "concat_rows", "from_gguf_blocks", "load", "requantize"]
