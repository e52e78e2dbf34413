"""Quantized weights: exact format conversion, kernel arithmetic, and measured quality on SmolLM2."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from kvgen import LLM
from kvgen.kernels import amx_tiles, load, requantize
from kvgen.kernels.build import kernel_isa
from kvgen.kernels.formats import EXACT_SOURCES, QK, QuantizedWeight
from kvgen.models.quantized_linear import QuantizedLinear
from kvgen.quality import score
from tests.support.models import model_path
from tests.support.k_quants import iq4_weight, q4k_weight, q5m_weight, q6k_weight
from tests.support.matmul_paths import matmul_path  # noqa: F401  (a fixture)
from tests.support.shakespeare import play_text
from tests.support.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.skipif(load() is None, reason="quantized kernels need a C compiler")
Q = gguf.GGMLQuantizationType


def integer_reference(weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
    """What the kernels compute, in float64: int8 activation blocks dotted with the weight integers."""
    linear = QuantizedLinear(weight)
    dense = linear.dequantized().double()  # [N, K] = d * q + m
    xb = x.double().reshape(x.shape[0], -1, QK)
    d = xb.abs().amax(-1, keepdim=True) / 127
    xq = torch.round(xb / torch.where(d > 0, d, torch.ones_like(d))) * d  # dequantized int8 activations
    return xq.reshape(x.shape) @ dense.T


def random_weight(kind: str, n: int, k: int) -> QuantizedWeight:
    """A weight of `kind`: floats rounded to it, or random valid GGUF blocks for the formats that only
    come from files (q4k, q6k, iq4, q5m)."""
    from_file = {"q4k": q4k_weight, "q6k": q6k_weight, "iq4": iq4_weight, "q5m": q5m_weight}.get(kind)
    return from_file(n, k) if from_file else requantize(torch.randn(n, k) * 0.05, kind)


@pytest.mark.parametrize("kind", ["q4", "q4h", "q8", "q8s", "q5", "iq4", "q5m"])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 70])
def test_kernel_matches_its_integer_arithmetic(kind: str, rows: int) -> None:
    torch.manual_seed(rows)
    weight = random_weight(kind, 100, 256)  # 100 rows: q4's last group of 8 is partial
    x = torch.randn(rows, 256)
    y = QuantizedLinear(weight)(x, row_invariant=True)  # the C kernel at any row count
    expected = integer_reference(weight, x)
    torch.testing.assert_close(y.double(), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["q4", "q4h", "q8", "q8s", "q5", "iq4", "q5m"])
def test_a_row_gets_the_same_bits_at_any_row_count(kind: str, matmul_path: str) -> None:
    """Decode, batched decode, verify and prefill multiply a row with the same sums in the same order."""
    torch.manual_seed(0)
    linear = QuantizedLinear(random_weight(kind, 72, 256))
    x = torch.randn(131, 256)
    alone = torch.cat([linear(x[i : i + 1], row_invariant=True) for i in range(x.shape[0])])
    for rows in (2, 3, 4, 5, 64, 65, 131):
        assert torch.equal(linear(x[:rows], row_invariant=True), alone[:rows]), rows


@pytest.mark.skipif("amx_tile" not in kernel_isa(), reason="the AMX tiles need a CPU with AMX and kernels built for it")
@pytest.mark.parametrize("kind", ["q4", "q4h", "q5", "q8", "q8s", "q4k", "q6k"])  # iq4 has no AMX kernel
def test_amx_tiles_give_the_vector_kernels_bits(kind: str) -> None:
    """From 16 rows (q4, q4h, q5: 32) the matmuls multiply whole tiles of 16 rows in AMX and apply
    each block's scales as the vector kernels do, so a prompt's rows get the bits a decode step gets."""
    assert amx_tiles(), "this CPU has AMX but the kernels are not using it (Linux refused the tile state?)"
    torch.manual_seed(0)
    # 100 outputs: a partial last group of 8; 2,304 inputs: 72 blocks, more than one unpacked span
    linear = QuantizedLinear(random_weight(kind, 100, 2304))
    x = torch.randn(200, 2304)
    try:
        for rows in (16, 32, 47, 64, 131, 200):
            with_tiles = linear(x[:rows], row_invariant=True)
            assert not amx_tiles(False)
            assert torch.equal(linear(x[:rows], row_invariant=True), with_tiles), rows
            assert amx_tiles(True)
    finally:
        amx_tiles(True)


def test_f16_four_bit_blocks_give_the_f32_blocks_bits() -> None:
    """q4h (GGUF's Q4_1 blocks: f16 scale and offset) reads a sixth fewer bytes than q4 and computes
    the same sums: the same integers with the same scales, converted exactly."""
    from kvgen.kernels.formats import concat_rows, to_q4

    torch.manual_seed(1)
    compact = requantize(torch.randn(100, 256) * 0.05, "q4h")
    wide = to_q4(compact)
    assert (compact.kind, wide.kind) == ("q4h", "q4")
    assert compact.blocks.numel() * 6 == wide.blocks.numel() * 5
    x = torch.randn(70, 256)
    for rows in (1, 5, 19, 70):
        assert torch.equal(QuantizedLinear(compact)(x[:rows], row_invariant=True),
                           QuantizedLinear(wide)(x[:rows], row_invariant=True)), rows  # fmt: skip
    fused = concat_rows([compact, requantize(torch.randn(8, 256), "q4")])  # mixed 4-bit parts meet in q4
    assert fused.kind == "q4" and torch.equal(QuantizedLinear(fused).dequantized()[:100], QuantizedLinear(wide).dequantized())


def test_q4_0_whose_offset_leaves_f16_keeps_f32_scales() -> None:
    from kvgen.kernels.formats import from_gguf_blocks

    block = np.zeros(18, dtype=np.uint8)
    block[0:2] = np.array([10000.0], dtype=np.float16).view(np.uint8)  # -8 d = -80000: beyond f16
    block[2:] = 0x98  # elements 8 (low nibbles) and 9 (high)
    weight = from_gguf_blocks("Q4_0", block[None], "q4h")
    assert weight.kind == "q4"
    values = QuantizedLinear(weight).dequantized()[0]
    assert values[:16].eq(0).all() and values[16:].eq(10000).all()
    ordinary = block.copy()
    ordinary[0:2] = np.array([0.5], dtype=np.float16).view(np.uint8)
    assert from_gguf_blocks("Q4_0", ordinary[None], "q4h").kind == "q4h"


@pytest.mark.parametrize("kind", ["q4", "q4h", "q8", "q8s", "q5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_use_a_dequantized_gemm(kind: str, dtype: torch.dtype) -> None:
    weight = requantize(torch.randn(64, 128), kind)
    bias = torch.arange(64.0)
    linear = QuantizedLinear(weight, bias=bias)
    linear.prefill = "bf16" if dtype == torch.bfloat16 else "fp32"
    dense = linear.dequantized()
    # The bf16 weights are the fp32 ones rounded to nearest even (the C conversion matches torch's).
    assert torch.equal(linear.dequantized(dtype=torch.bfloat16), dense.bfloat16())
    x = torch.randn(2, linear.gemm_rows, 128)
    expected = F.linear(x.to(dtype), dense.to(dtype)).float() + bias
    torch.testing.assert_close(linear(x), expected, rtol=0, atol=0)
    # One row fewer takes the C path (int8 activation blocks): close to the GEMM, not the same.
    fewer = x[:1, :-1]
    torch.testing.assert_close(linear(fewer), F.linear(fewer, dense, bias), rtol=0.05, atol=0.3)


# gguf-py cannot write K-quants: Q4_K is checked on random super-blocks and the real file (test_k_quants.py).
@pytest.mark.parametrize("type_name", sorted(t for t in EXACT_SOURCES if not t.endswith("_K") and not t.startswith("IQ")))
@pytest.mark.parametrize("mode", ["int8", "q4"])
def test_exact_sources_keep_their_values(type_name: str, mode: str, tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", weight_type=Q[type_name])
    reference = LLM.load(path, progress=False, weights="fp32").model
    quantized = LLM.load(path, progress=False, weights=mode).model
    exact = reference.layers[0].attn.qkv.weight
    ours = quantized.layers[0].attn.qkv.dequantized()
    torch.testing.assert_close(ours, exact, rtol=0, atol=1e-6)  # same integers and scales, f32 rounding only
    expected_kind = EXACT_SOURCES[type_name] if mode == "q4" else ("q8s" if type_name in ("Q8_0", "Q5_0", "MXFP4") else "q8")  # Q5_1: q5m
    assert quantized.layers[0].attn.qkv.kind == expected_kind


@pytest.mark.parametrize("type_name", ["IQ4_NL", "IQ4_XS", "Q3_K"])
@pytest.mark.parametrize("mode", ["int8", "q4"])
def test_iq4_and_q3k_sources_keep_their_values(type_name: str, mode: str, tmp_path: Path) -> None:
    """IQ4's indices and scales move into iq4 blocks (q4) or its int8 levels into 8-bit blocks (int8)
    unchanged, Q3_K's integers and scales into q6k super-blocks (q4) or, as their products, into q8
    blocks (int8); in IQ4_XS and Q3_K files the rows shorter than a 256-weight super-block are IQ4_NL,
    as llama-quantize writes them."""
    path = write_tiny_gguf(tmp_path / "m.gguf", weight_type=Q[type_name], hidden=256)
    reference = LLM.load(path, progress=False, weights="fp32").model.layers[0]
    quantized = LLM.load(path, progress=False, weights=mode).model.layers[0]
    linears = {"qkv": (reference.attn.qkv, quantized.attn.qkv), "down": (reference.mlp.down, quantized.mlp.down)}
    for name, (exact, ours) in linears.items():
        torch.testing.assert_close(ours.dequantized(), exact.weight, rtol=0, atol=1e-6, msg=name)
    expected = {"q4": ("q6k" if type_name == "Q3_K" else "iq4", "iq4"), "int8": ("q8s" if type_name == "IQ4_NL" else "q8", "q8s")}[mode]
    assert (quantized.attn.qkv.kind, quantized.mlp.down.kind) == expected  # down: 128-weight rows, IQ4_NL in both files


@pytest.mark.parametrize("type_name", ["IQ4_XS", "Q5_1", "Q3_K"])
def test_iq4_q5m_and_q3k_models_decode_alike_in_c_in_torch_and_in_the_engine(type_name: str, tmp_path: Path) -> None:
    """A model whose weights are iq4 (IQ4_XS, IQ4_NL), q5m (Q5_1) or Q3_K's q6k blocks: the C decode
    step, the torch path over the same kernels and the engine's batched rows step give the same
    greedy tokens."""
    from kvgen import SamplingParams
    from kvgen.engine import EngineConfig, LLMEngine

    llm = LLM.load(write_tiny_gguf(tmp_path / "m.gguf", weight_type=Q[type_name], hidden=256), progress=False)
    kinds = {layer.kind for block in llm.model.layers for layer in (block.attn.qkv, block.mlp.gate_up, block.mlp.down)}
    assert kinds == {"IQ4_XS": {"iq4"}, "Q5_1": {"q5m"}, "Q3_K": {"q6k", "iq4"}}[type_name] and llm.model.fast_decoder() is not None
    params, prompts = SamplingParams(max_new_tokens=24, ignore_eos=True), ["The cat", "Once upon a time there", "Tea"]
    alone = [llm.generate(p, params).token_ids for p in prompts]
    llm.model.use_fast_decode = False
    try:
        assert [llm.generate(p, params).token_ids for p in prompts] == alone
    finally:
        llm.model.use_fast_decode = True
    engine = LLMEngine(llm, EngineConfig(num_blocks=64, max_tokens_per_step=12))  # chunked prefill, batched rows
    assert [r.output_ids for r in engine.generate(prompts, params)] == alone


def test_corrupted_scales_are_caught_in_quantized_mode(tmp_path: Path) -> None:
    from kvgen import ModelLoadError
    from kvgen.loading.gguf_file import GGUFFile

    path = write_tiny_gguf(tmp_path / "m.gguf", weight_type=Q.Q4_1)
    info = GGUFFile(path).tensors["blk.1.ffn_up.weight"]
    data = bytearray(path.read_bytes())
    data[info.offset : info.offset + 2] = np.array([np.inf], dtype=np.float16).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"'blk.1.ffn_up.weight'.*NaN or infinite"):
        LLM.load(path, progress=False, weights="q4")


def test_auto_mode_picks_four_bit_kernels_for_a_quantized_gguf() -> None:
    llm = LLM.load(model_path("smollm2"), progress=False)
    assert llm.weights == "q4"
    assert llm.model.layers[0].mlp.gate_up.kind == "q4h"  # Q4_1 in the file, its blocks as they are
    assert llm.model.lm_head.kind == "q8s"  # the tied Q8_0 embedding, its blocks as they are


# The stated tolerance (docs/benchmarks.md): perplexity on Hamlet, decoded 8 tokens at a time so
# the int8-activation kernels run, within these fractions of the fp32 weights' perplexity.
PPL_TOLERANCE = {"int8": 0.02, "q4": 0.02}  # measured +1.10% for both (int8 activations)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int8", "q4"])
def test_perplexity_change_within_stated_tolerance(smollm2, mode: str) -> None:
    ids = smollm2.tokenizer.encode(play_text("hamlet"))[:257]
    exact = score(smollm2.model, smollm2.generator.new_cache, ids, chunk_size=8).perplexity
    fast = LLM.load(model_path("smollm2"), progress=False, weights=mode)
    measured = score(fast.model, fast.generator.new_cache, ids, chunk_size=8).perplexity
    assert abs(measured - exact) / exact < PPL_TOLERANCE[mode], (exact, measured)


def test_prefill_runs_the_int8_kernel_unless_overridden(monkeypatch) -> None:
    from kvgen.models.quantized_linear import NEVER, prefill_path

    monkeypatch.delenv("KVGEN_PREFILL_GEMM", raising=False)
    assert prefill_path() == "int8"  # the C kernel at every row count, native bf16 or not
    monkeypatch.setenv("KVGEN_PREFILL_GEMM", "int8")  # the C kernel at every row count
    assert QuantizedLinear(requantize(torch.randn(64, 128), "q4")).gemm_rows == NEVER
    assert QuantizedLinear(requantize(torch.randn(64, 128), "q8")).gemm_rows == NEVER
    monkeypatch.setenv("KVGEN_PREFILL_GEMM", "fp32")
    assert prefill_path() == "fp32"
    assert QuantizedLinear(requantize(torch.randn(64, 128), "q4")).gemm_rows == 48
    monkeypatch.setenv("KVGEN_PREFILL_GEMM", "bf16")
    assert QuantizedLinear(requantize(torch.randn(64, 128), "q4")).gemm_rows == 24
    monkeypatch.setenv("KVGEN_PREFILL_GEMM", "fp16")
    with pytest.raises(ValueError, match="KVGEN_PREFILL_GEMM must be auto, int8, fp32 or bf16, got 'fp16'"):
        prefill_path()


def test_avx2_and_portable_builds_give_the_native_builds_bits(tmp_path: Path) -> None:
    """The kernels promise the same bits on every instruction set: build them for AVX2 without F16C
    or VNNI (an AVX2-only machine's paths), for AVX-512 without VNNI (8-row tiles over AVX2's
    multiply-adds) and for no vector extension at all, and compare."""
    import ctypes
    import subprocess

    from kvgen.kernels.build import SOURCE

    pointer, count = ctypes.c_void_p, ctypes.c_int64
    torch.manual_seed(3)
    x = torch.randn(19, 256)  # 19 rows: full and partial tiles of every build's tile height
    builds = (("avx2", ["-mavx2", "-mfma"]), ("avx512-without-vnni", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma", "-mf16c"]),
              ("portable", []))  # fmt: skip
    for name, flags in builds:
        target = tmp_path / f"{name}.so"
        subprocess.run(["gcc", "-O3", *flags, "-fopenmp", "-shared", "-fPIC", "-std=c11", str(SOURCE), "-o", str(target), "-lm"],
                       check=True)  # fmt: skip
        other = ctypes.CDLL(str(target))
        for kind in ("q4", "q4h", "q8", "q8s", "q5", "q4k", "q6k", "iq4", "q5m"):
            linear = QuantizedLinear(random_weight(kind, 100, 256))
            function = getattr(other, f"kvgen_linear_{kind}x8")
            function.argtypes = [pointer] * 4 + [count] * 3
            for rows in (1, 5, 19):
                expected = linear(x[:rows], row_invariant=True)
                scratch, y = torch.empty(rows * 8 * 40, dtype=torch.uint8), torch.empty(rows, 100)
                function(linear.blocks.data_ptr(), x.data_ptr(), scratch.data_ptr(), y.data_ptr(), rows, 100, 256)
                assert torch.equal(y, expected), (name, kind, rows)
