"""The per-row C operations of the torch blocks (kernels/rows_ops.c) against torch's expressions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvgen.kernels import load
from kvgen.kv.rotation import rotate_half
from kvgen.models.layers import RMSNorm
from kvgen.models.rotary import RotaryEmbedding, apply_rotary, inverse_frequencies

pytestmark = pytest.mark.skipif(load() is None, reason="the row operations need a C compiler")


@pytest.mark.parametrize("batch, seq", [(1, 1), (1, 37), (3, 5)])
def test_rope_gives_the_torch_expressions_bits(batch: int, seq: int) -> None:
    """On the strided q view attention hands it, with one or per-row angles."""
    torch.manual_seed(seq)
    qkv = torch.randn(batch, seq, 15 * 64) * 3
    q = qkv[..., : 9 * 64].view(batch, seq, 9, 64).transpose(1, 2)  # [B, H, S, D], not contiguous
    positions = torch.arange(100, 100 + seq).expand(batch, seq) if batch == 1 else torch.randint(0, 4000, (batch, seq))
    cos, sin = RotaryEmbedding(inverse_frequencies(64, 10000.0, None))(positions, torch.float32)
    assert torch.equal(apply_rotary(q, cos, sin), q * cos + rotate_half(q) * sin)


def test_rms_norm_matches_torch_and_ignores_the_row_count() -> None:
    torch.manual_seed(0)
    norm = RMSNorm(torch.randn(576), 1e-5)
    x = torch.randn(2, 70, 576) * 4
    y = norm(x)
    reference = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(y, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(norm(x[1, 9:10]), y[1, 9:10])


def gated_in_c(gate_up: torch.Tensor, act: int) -> torch.Tensor:
    out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2)
    load().kvgen_gated_rows(gate_up.data_ptr(), gate_up.shape[0], out.shape[1], act, out.data_ptr())
    return out


@pytest.mark.parametrize("act", [0, 1])
def test_gated_activations_match_torch_and_ignore_the_row_count(act: int) -> None:
    """SwiGLU (0) and tanh-GELU's GeGLU (1), the C decode step's, over many rows."""
    torch.manual_seed(1)
    gate_up = torch.randn(40, 2 * 100) * 4  # 100: the vector loop and its scalar tail
    hidden = gated_in_c(gate_up, act)
    gate, up = gate_up[:, :100], gate_up[:, 100:]
    reference = (F.silu(gate) if act == 0 else F.gelu(gate, approximate="tanh")) * up
    torch.testing.assert_close(hidden, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(gated_in_c(gate_up[7:8].clone(), act), hidden[7:8])


def test_argmax_is_torchs_with_any_instruction_set(tmp_path) -> None:
    """Greedy decoding's argmax in C: the first maximum (ties, -0.0 against 0.0), the first NaN,
    all -inf, lengths off the 8-lane loop; the AVX2 and scalar builds choose the same."""
    from tests.unit.test_quantized_kv_attention import instruction_sets
    from kvgen.kernels.build import build, open_library
    from kvgen.sampling.sampler import argmax

    torch.manual_seed(2)
    cases = [torch.randn(n) for n in (1, 7, 8, 13, 262144)]
    tied = torch.randn(1000)
    tied[[17, 400, 999]] = tied.max() + 1
    with_nan = torch.randn(301)
    with_nan[[250, 299]] = float("nan")
    cases += [tied, with_nan, torch.full((20,), float("-inf")), torch.tensor([-0.0, 0.0, -1.0]),
              torch.tensor([1.0, float("inf"), float("nan"), float("inf")])]  # fmt: skip
    expected = [int(torch.argmax(x)) for x in cases]
    assert [argmax(x) for x in cases] == expected
    for name, flags in instruction_sets().items():
        build(tmp_path / f"{name}.so", flags)
        library = open_library(tmp_path / f"{name}.so")
        assert [library.kvgen_argmax_f32(x.data_ptr(), x.numel()) for x in cases] == expected, name
