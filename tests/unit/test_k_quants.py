"""q4k / q6k: GGUF's Q4_K and Q6_K super-blocks kept as the file has them (kernels/k_quants.c), Q3_K
in Q6_K's super-blocks; Q5_K in q5m blocks (kernels/interleaved.c)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvgen.kernels import load
from kvgen.kernels.formats import from_gguf_blocks, to_q8
from kvgen.models.quantized_linear import QuantizedLinear
from tests.support.k_quants import q4k_weight, q6k_weight, random_q3k, random_q4k, random_q5k, random_q6k
from tests.support.matmul_paths import matmul_path  # noqa: F401  (a fixture)

pytestmark = pytest.mark.skipif(load() is None, reason="quantized kernels need a C compiler")


def test_dequantized_weights_are_ggufs_values_bit_for_bit() -> None:
    raw = random_q4k(100, 512)  # 100 rows: the last group of 8 is partial
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)
    linear = QuantizedLinear(from_gguf_blocks("Q4_K", raw, "q4k"))
    ours = linear.dequantized().numpy()
    assert np.array_equal(ours.view(np.uint32), expected.astype(np.float32).view(np.uint32))
    assert torch.equal(linear.dequantized(dtype=torch.bfloat16), torch.from_numpy(ours).bfloat16())  # bf16 prefill GEMM
    as_q8 = QuantizedLinear(from_gguf_blocks("Q4_K", raw, "q8")).dequantized().numpy()
    assert np.array_equal(as_q8, expected)  # --weights int8: the same integers in q8 blocks


def test_q5k_keeps_ggufs_values_bit_for_bit_in_q5m_and_q8_blocks() -> None:
    raw = random_q5k(100, 512)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_K).astype(np.float32)
    for kind in ("q5m", "q8"):  # --weights q4 (the default) and int8
        ours = QuantizedLinear(from_gguf_blocks("Q5_K", raw, kind)).dequantized().numpy()
        assert np.array_equal(ours.view(np.uint32), expected.view(np.uint32)), kind
    assert np.array_equal(QuantizedLinear(to_q8(from_gguf_blocks("Q5_K", raw, "q5m"))).dequantized().numpy(), expected)


def test_q3k_keeps_ggufs_values_bit_for_bit_in_q6k_blocks() -> None:
    raw = random_q3k(100, 512, seed=5)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q3_K).astype(np.float32)
    weight = from_gguf_blocks("Q3_K", raw, "q6k")
    assert weight.kind == "q6k"
    assert np.array_equal(QuantizedLinear(weight).dequantized().numpy().view(np.uint32), expected.view(np.uint32))


def test_q3k_in_eight_bit_blocks_keeps_its_values() -> None:
    """--weights int8 and fused weights that meet in q8: a 32-weight block keeps the integers
    (sc - 32) * q with the super-block's d, so its dots equal q6k's. A product of 128 (scale -32
    times q = -4) does not fit int8: q8 takes every product less 1 and d as the offset (exact), q8s
    rounds such blocks."""
    raw = random_q3k(100, 512, seed=6, fits_int8=True)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q3_K).astype(np.float32)
    q6k = from_gguf_blocks("Q3_K", raw, "q6k")
    as_q6k = QuantizedLinear(q6k)
    x = torch.randn(9, 512)
    eight_bit = [from_gguf_blocks("Q3_K", raw, "q8s"), from_gguf_blocks("Q3_K", raw, "q8"), to_q8(q6k)]
    assert [w.kind for w in eight_bit] == ["q8s", "q8", "q8"]
    for weight in eight_bit:
        linear = QuantizedLinear(weight)
        assert np.array_equal(linear.dequantized().numpy(), expected), weight.kind
        assert torch.equal(linear(x, row_invariant=True), as_q6k(x, row_invariant=True)), weight.kind
    unfit = random_q3k(100, 512, seed=6)  # some scales -32
    expected = gguf.quants.dequantize(unfit, gguf.GGMLQuantizationType.Q3_K)
    offset = from_gguf_blocks("Q3_K", unfit, "q8")
    assert np.array_equal(QuantizedLinear(offset).dequantized().numpy(), expected)
    assert (offset.scales()[..., 1] != 0).any()  # some blocks needed the offset
    symmetric = QuantizedLinear(from_gguf_blocks("Q3_K", unfit, "q8s")).dequantized().numpy()
    blocks_equal = (symmetric == expected).reshape(100, -1, 32).all(-1)
    assert 0.9 < blocks_equal.mean() < 1.0  # blocks with a 128 round, the others stay exact


def test_q6k_dequantizes_to_ggufs_values_and_computes_their_integer_dots() -> None:
    raw = random_q6k(100, 512, seed=2)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K)
    linear = QuantizedLinear(from_gguf_blocks("Q6_K", raw, "q6k"))
    assert np.array_equal(linear.dequantized().numpy().view(np.uint32), expected.view(np.uint32))
    assert torch.equal(linear.dequantized(dtype=torch.bfloat16), torch.from_numpy(expected).bfloat16())
    x = torch.randn(9, 512, dtype=torch.float64)
    xb = x.reshape(9, -1, 32)
    scale = xb.abs().amax(-1, keepdim=True) / 127
    rounded = (torch.round(xb / scale) * scale).reshape(9, 512)  # the kernels' int8 activation blocks
    reference = rounded @ torch.from_numpy(expected).double().T
    torch.testing.assert_close(linear(x.float(), row_invariant=True).double(), reference, rtol=1e-5, atol=1e-6)


def test_q6k_rows_get_the_same_bits_at_any_row_count(matmul_path: str) -> None:
    """The 8-output kernel (one row, a few), the 512-bit pair kernel and the AMX tiles (many rows)
    give a row the same bits."""
    linear = QuantizedLinear(q6k_weight(100, 512, seed=3))
    x = torch.randn(70, 512)
    alone = torch.cat([linear(x[i : i + 1], row_invariant=True) for i in range(x.shape[0])])
    for rows in (2, 3, 4, 5, 64, 65, 70):
        assert torch.equal(linear(x[:rows], row_invariant=True), alone[:rows]), rows


def test_a_row_gets_the_q8_kernels_bits_at_any_row_count(matmul_path: str) -> None:
    """q4k's sums are q8's over the same integers and scales, in the same order, at every row count."""
    weight = q4k_weight(100, 512, seed=1)
    linear, reference = QuantizedLinear(weight), QuantizedLinear(to_q8(weight))
    x = torch.randn(70, 512)
    alone = torch.cat([linear(x[i : i + 1], row_invariant=True) for i in range(x.shape[0])])
    assert torch.equal(alone, reference(x, row_invariant=True))
    for rows in (2, 3, 4, 5, 64, 65, 70):
        assert torch.equal(linear(x[:rows], row_invariant=True), alone[:rows]), rows


def test_the_real_files_k_quant_tensors_keep_their_values() -> None:
    """Gemma 3 270M Q4_K_M: attn_output and half of ffn_down are Q4_K, the other half Q6_K; --weights
    q4 keeps them as q4k and q6k with gguf's values."""
    from kvgen.loading.gguf_file import GGUFFile
    from kvgen.loading.weight_format import quantize_gguf_rows
    from tests.support.models import model_path

    file = GGUFFile(model_path("gemma3-270m"))
    downs = {t.type_name: n for n, t in file.tensors.items() if n.endswith("ffn_down.weight")}
    assert file.tensors["blk.0.attn_output.weight"].type_name == "Q4_K" and {"Q4_K", "Q6_K"} <= set(downs)
    for name in ("blk.0.attn_output.weight", downs["Q4_K"], downs["Q6_K"]):
        info = file.tensors[name]
        weight = quantize_gguf_rows(info.type_name, file.raw(info), None, "q4")
        assert weight.kind == info.type_name.lower().replace("_", "")
        expected = gguf.quants.dequantize(file.raw(info), gguf.GGMLQuantizationType[info.type_name])
        assert np.array_equal(QuantizedLinear(weight).dequantized().numpy(), expected), name
