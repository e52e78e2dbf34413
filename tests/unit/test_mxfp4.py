"""MXFP4 (gpt-oss's experts): GGUF rows into mx4 blocks (the file's codes and scales, at its 4.25
bits) or exact 8-bit blocks, checked against gguf-py's dequantization; the kernels' products over
mx4 against the same integers in 8-bit blocks; the Hugging Face checkpoints' packed bytes decoded
as transformers decodes them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvgen.kernels.formats import from_gguf_blocks
from kvgen.loading.gpt_oss_experts import decode_mxfp4
from kvgen.models.quantized_linear import QuantizedLinear


def mxfp4_rows(seed: int) -> np.ndarray:
    """gguf-py's MXFP4 rows of random weights [8, 128], one block all zeros."""
    import gguf

    values = np.random.default_rng(seed).normal(0, 0.05, (8, 128)).astype(np.float32)
    values[0, :32] = 0.0
    return gguf.quants.quantize(values, gguf.GGMLQuantizationType.MXFP4)


def file_values(rows: np.ndarray) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(rows, gguf.GGMLQuantizationType.MXFP4)


@pytest.mark.parametrize("kind", ["mx4", "q8s", "q8"])
def test_gguf_rows_keep_their_values(kind: str) -> None:
    rows = mxfp4_rows(0)
    weight = from_gguf_blocks("MXFP4", rows, kind)  # type: ignore[arg-type]
    assert weight.kind == kind
    assert np.array_equal(QuantizedLinear(weight, None).dequantized().numpy(), file_values(rows))


def test_a_scale_beyond_f16_keeps_f32_scales() -> None:
    rows = mxfp4_rows(1)
    rows[3, 17] = 40  # block 1 of row 3: 2^-88, below f16's subnormals
    weight = from_gguf_blocks("MXFP4", rows, "q8s")
    assert weight.kind == "q8"
    assert np.array_equal(QuantizedLinear(weight, None).dequantized().numpy(), file_values(rows))


@pytest.mark.parametrize("rows", [1, 3, 8, 40])
def test_mx4_products_equal_the_eight_bit_blocks(rows: int) -> None:
    """The batch-1 linear and the many-row GEMM over mx4 give the products of the same integers and
    scales in q8s blocks (exact integer dots, the same float steps)."""
    weights = mxfp4_rows(3)
    mx4 = QuantizedLinear(from_gguf_blocks("MXFP4", weights, "mx4"), None)
    q8s = QuantizedLinear(from_gguf_blocks("MXFP4", weights, "q8s"), None)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        torch.testing.assert_close(mx4(x), q8s(x), rtol=0, atol=0)


def test_four_bit_blocks_round_the_values() -> None:
    rows = mxfp4_rows(2)
    rounded = QuantizedLinear(from_gguf_blocks("MXFP4", rows, "q4"), None).dequantized().numpy()
    error = np.abs(rounded - file_values(rows)).max()
    assert 0 < error < 0.02


def test_hf_checkpoint_bytes_decode_as_transformers_decodes_them() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    generator = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 6, 4, 16), dtype=torch.uint8, generator=generator)  # [E, rows, columns / 32, 16]
    scales = torch.randint(118, 130, (2, 6, 4), dtype=torch.uint8, generator=generator)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, columns, rows]
    assert torch.equal(decode_mxfp4(blocks, scales), expected.transpose(1, 2))


def test_mismatched_blocks_and_scales_are_refused() -> None:
    with pytest.raises(ValueError, match="do not pair"):
        decode_mxfp4(torch.zeros(2, 6, 4, 16, dtype=torch.uint8), torch.zeros(2, 6, 3, dtype=torch.uint8))
