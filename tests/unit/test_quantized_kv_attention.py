"""Decode attention over a QuantizedCache's stored codes (kernels/quantized_attention.c) computes
what softmax attention over the decoded history computes, gives the same bits for any thread count
and instruction set, and the C decode step uses it without ever decoding the history into the
cache's scratch buffer."""

from __future__ import annotations

import math
import platform
from pathlib import Path

import pytest
import torch

from kvgen import LLM
from kvgen.kernels import load
from kvgen.kernels.build import FLAGS, _cpu_flags, build, open_library
from kvgen.kv import paged_codes_batch
from kvgen.kv.block_pool import BlockPool
from kvgen.kv.codecs import Int8KeyCodec, key_codec, value_codec
from kvgen.kv.interface import AttentionSpan, CacheSpec
from kvgen.kv.paged_codes import QuantizedPagedStorage
from kvgen.kv.paged_codes_batch import QuantizedPagedBatchView
from kvgen.kv.paged_codes_cache import QuantizedPagedCache
from kvgen.cache_factory import build_quantized_cache
from kvgen.kv.kvquant import KVQuantKeyCodec, KVQuantValueCodec
from kvgen.kv.quantized import QuantizedCache
from kvgen.kv import quantized_decode_view
from kvgen.kv.quantized_decode_view import QuantizedDecodeView
from tests.support.models import model_path

pytestmark = pytest.mark.skipif(load() is None, reason="the kernel needs a C compiler")

READABLE = [("int8", "int8"), ("int4", "int4"), ("fp16", "fp8"), ("bf16", "fp32"), ("fp32", "int4"), ("fp8", "fp16")]


class SinkInt8(Int8KeyCodec):
    """int8 that keeps the first position whole, as kvquant3 does (exercises the sink segment)."""

    sink_tokens = 1


def toy_rope(layer: int, positions: torch.Tensor, rotary: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama-style RoPE tables [N, rotary] (64: whole heads; fewer: partial rotary, Phi-4-mini), a
    different base per layer (as Gemma's local/global layers)."""
    inverse = 1.0 / (10000.0 * (1 + layer)) ** (torch.arange(0, rotary, 2).float() / rotary)
    angles = positions.float()[:, None] * inverse
    return torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()


def partial_rope(layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE over the first 48 of 64 channels."""
    return toy_rope(layer, positions, 48)


def kvquant3_cache(spec: CacheSpec, capacity: int, max_capacity: int, rope=toy_rope) -> QuantizedCache:
    """kvquant3 keys (per-channel codebook, 1 exact outlier per position, before RoPE) and values,
    with made-up sorted codebooks: the kernel must read whatever levels calibration produced."""
    levels = torch.rand(spec.num_layers, 8, generator=torch.Generator().manual_seed(1)).sort(-1).values
    levels[:, 0], levels[:, -1] = 0.0, 1.0
    keys, values = KVQuantKeyCodec(levels.contiguous(), outliers=1), KVQuantValueCodec(levels.flip(-1).neg().add(1).contiguous())
    return QuantizedCache(spec, capacity, max_capacity, keys, values, key_rope=rope)


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """Softmax attention of q [heads, D] over keys/values [H_kv, L, D] from `start`, grouped heads."""
    heads, dim = q.shape
    kv_heads = keys.shape[0]
    scores = q.view(kv_heads, heads // kv_heads, dim) @ keys[:, start:].transpose(1, 2) / math.sqrt(dim)
    return (torch.softmax(scores, -1) @ values[:, start:]).reshape(heads, dim)


# int8 keys are scored against the query rounded to int16 codes (step max|q| / 32512), and int8
# values summed with each tile's weights rounded to 15 bits: on these inputs (keys up to ~14,
# values ~N(0, 1)) that moves the output by up to 1e-4. 4-bit keys are scored against q x the
# block's steps rounded the same way, but their codes run 0..15 over the whole range (int8's
# -127..127 span it twice as finely about zero), so the rounding weighs about twice as much; 4-bit
# values get 15-bit weights per 32-channel group. Every other codec is read as floats.
INT8_TOLERANCE = 2e-4
INT4_TOLERANCE = 4e-4


def filled_cache(k_dtype, v_dtype, length: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[QuantizedCache, QuantizedDecodeView]:
    """A 2-layer cache holding keys/values [1, 3, length, D] of layer 1, the last position written
    as the C step writes it (uncommitted), and the kernel's view of it."""
    spec = CacheSpec(num_layers=2, num_kv_heads=3, head_dim=keys.shape[-1])
    if k_dtype in ("kvquant3", "kvquant3-partial"):
        cache = kvquant3_cache(spec, 64, 1024, partial_rope if k_dtype == "kvquant3-partial" else toy_rope)
    else:
        cache = QuantizedCache(spec, 64, 4096, k_dtype, v_dtype)
    for layer in range(2):
        cache.update(layer, keys[:, :, :-1], values[:, :, :-1])
    cache.commit(length - 1)
    attention = QuantizedDecodeView()
    attention.prepare(cache, length)
    cache.write(1, keys[:, :, -1:], values[:, :, -1:])
    return cache, attention


def attend(cache: QuantizedCache, attention: QuantizedDecodeView, q: torch.Tensor, start: int) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))
    attention.attend(cache, 1, q.data_ptr(), out.data_ptr(), q.shape[0], 1 / math.sqrt(q.shape[1]), start, cache.seq_len + 1)
    return out


@pytest.mark.parametrize("k_dtype,v_dtype", [*READABLE, (SinkInt8(), "int4"), ("int8", "fp32"), ("fp32", "int8"), ("kvquant3", "kvquant3"),
                                         ("kvquant3-partial", "kvquant3")])
@pytest.mark.parametrize("length,start", [(1, 0), (7, 0), (64, 0), (100, 0), (333, 0), (333, 280), (333, 150)])
def test_attention_over_codes_equals_attention_over_the_decoded_history(k_dtype, v_dtype, length: int, start: int) -> None:
    torch.manual_seed(length + start)
    keys, values = torch.randn(1, 3, length, 64) * 2, torch.randn(1, 3, length, 64)
    keys[..., 5] += 8  # an outlier channel, as real keys have
    cache, attention = filled_cache(k_dtype, v_dtype, length, keys, values)
    q = torch.randn(9, 64)
    out = attend(cache, attention, q, start)
    decoded_keys, decoded_values = cache._assemble(1, length)  # what the torch path reads
    expected = reference(q, decoded_keys[0], decoded_values[0], start)
    assert cache.num_packed_blocks == max(0, (length - 1 - cache.sink_tokens - 32) // 32)
    integer = {k_dtype if isinstance(k_dtype, str) else "int8", v_dtype}
    tolerance = INT4_TOLERANCE if "int4" in integer else INT8_TOLERANCE if "int8" in integer else 1e-5
    assert torch.allclose(out, expected, atol=tolerance, rtol=1e-5), (out - expected).abs().max()


@pytest.mark.parametrize("length,start,dim,heads", [(100, 0, 64, 9), (333, 150, 64, 9), (1000, 0, 64, 9),
                                                   (333, 150, 96, 15), (300, 0, 256, 12)])  # fmt: skip
def test_integer_key_scores_and_value_sums_are_exact(length: int, start: int, dim: int, heads: int) -> None:
    """Where no rounding happens (a query that is its own int16 codes; value rows of one scale under
    equal weights) the integer paths equal the float reference to 1e-5: every dot and every pair
    of value rows lands where it belongs, odd tiles, the position splits, a head size that is
    not a multiple of 64 and groups of 4 and 5 query heads included."""
    torch.manual_seed(length)
    codes = torch.randint(-32512, 32513, (heads, dim)).float()
    codes[:, 0] = 32512  # max |q| / 32512 = 2^-12: the kernel's codes are exactly these
    q = codes * 2.0**-12 / math.sqrt(dim)
    keys, values = torch.randn(1, 3, length, dim) * 2, torch.randn(1, 3, length, dim)
    cache, attention = filled_cache("int8", "fp32", length, keys, values)
    decoded_keys, decoded_values = cache._assemble(1, length)
    expected = reference(q, decoded_keys[0], decoded_values[0], start)
    assert torch.allclose(attend(cache, attention, q, start), expected, atol=1e-5, rtol=1e-5)

    values = torch.randint(-126, 127, (1, 3, length, dim)).float()
    values[..., 7] = 127  # every row's scale is 1 / 127 x its maximum, 127: all equal
    cache, attention = filled_cache("fp32", "int8", length, torch.zeros(1, 3, length, dim), values)
    decoded_keys, decoded_values = cache._assemble(1, length)
    expected = reference(q, decoded_keys[0], decoded_values[0], start)  # the mean of the values
    assert torch.allclose(attend(cache, attention, q, start), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length,start,dim,heads", [(100, 0, 64, 9), (333, 150, 64, 9), (1000, 0, 64, 9),
                                                   (333, 150, 96, 15), (300, 0, 256, 12)])  # fmt: skip
def test_4bit_key_scores_and_value_sums_are_exact(length: int, start: int, dim: int, heads: int) -> None:
    """As for int8: where nothing rounds, the 4-bit integer paths equal the float reference to 1e-5.
    Keys whose every block spans codes 0..15 in every channel (step 1, low -3: q x step is q, its
    own int16 codes) check each nibble against its query channel and the block's q . low; values
    whose every group spans 0..15 (step 1, low 0.5) under equal weights check each nibble of the
    pairs of rows and the low term, for 2, 3 and 8 channel groups."""
    torch.manual_seed(length)
    codes = torch.randint(-32512, 32513, (heads, dim)).float()
    codes[:, 0] = 32512
    q = codes * 2.0**-12 / math.sqrt(dim)
    keys = torch.randint(0, 16, (1, 3, length, dim)).float()
    keys[:, :, 0::32], keys[:, :, 1::32] = 0.0, 15.0  # every block's min and max in every channel
    cache, attention = filled_cache("int4", "fp32", length, keys - 3, torch.randn(1, 3, length, dim))
    decoded_keys, decoded_values = cache._assemble(1, length)
    assert torch.equal(decoded_keys[0, :, : 32 * cache.num_packed_blocks], (keys - 3)[0, :, : 32 * cache.num_packed_blocks])
    expected = reference(q, decoded_keys[0], decoded_values[0], start)
    assert torch.allclose(attend(cache, attention, q, start), expected, atol=1e-5, rtol=1e-5)

    values = torch.randint(0, 16, (1, 3, length, dim)).float()
    values[..., 0::32], values[..., 1::32] = 0.0, 15.0  # every group's min and max at every position
    cache, attention = filled_cache("fp32", "int4", length, torch.zeros(1, 3, length, dim), values + 0.5)
    decoded_keys, decoded_values = cache._assemble(1, length)
    assert torch.equal(decoded_values[0, :, : 32 * cache.num_packed_blocks], (values + 0.5)[0, :, : 32 * cache.num_packed_blocks])
    expected = reference(q, decoded_keys[0], decoded_values[0], start)  # the mean of the values
    assert torch.allclose(attend(cache, attention, q, start), expected, atol=1e-5, rtol=1e-5)


def instruction_sets() -> dict[str, list[str]]:
    """Builds of the kernels this machine can run besides its native one: AVX2 (no AVX-512) and
    none (plain x86-64), each with its own vector paths."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return {}
    portable = [flag for flag in FLAGS if flag != "-march=native"]
    sets = {"x86-64": [*portable, "-march=x86-64"]}
    if {"avx2", "fma", "f16c"} <= set(_cpu_flags().split()):
        sets["avx2"] = [*portable, "-march=x86-64", "-mavx2", "-mfma", "-mf16c"]
    return sets


def engine_pool_attention(window: int) -> torch.Tensor:
    """The engine's pool of int8 K/V codes read in place through block tables (16-position blocks,
    as the engine keeps them): a decode at 700 positions, a 5-token chunk after 300 (inside a
    block), a 20-token chunk after 33, all under `window` (0: none) -> their outputs, concatenated."""
    spec = CacheSpec(num_layers=2, num_kv_heads=3, head_dim=64)
    store = QuantizedPagedStorage(spec, BlockPool(128, 16), key_codec("int8"), value_codec("int8"), 8)
    generator = torch.Generator().manual_seed(7)
    caches = [QuantizedPagedCache(store) for _ in range(3)]
    for cache, history in zip(caches, (700, 300, 33)):
        for layer in range(2):
            keys = torch.randn(1, 3, history, 64, generator=generator) * 2
            cache.update(layer, keys, torch.randn(1, 3, history, 64, generator=generator))
        cache.commit(history)
    lengths = [1, 5, 20]
    q = torch.randn(3, 9, 20, 64, generator=generator)
    keys, values = torch.randn(3, 3, 20, 64, generator=generator) * 2, torch.randn(3, 3, 20, 64, generator=generator)
    view = QuantizedPagedBatchView(caches, lengths)
    out = view.attend_in_place(1, q, keys, values, 0.125, view.in_place_starts(lengths, (AttentionSpan(window or None),) * 3))
    return torch.cat([out[row, :, :n].flatten() for row, n in enumerate(lengths)])


def test_same_bits_for_any_thread_count_and_instruction_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Work is split at fixed positions and every sum runs in one order, so 1 or 2 threads and the
    AVX-512 / AVX2 / scalar builds give the same bits (int8 K/V with a sink; 4-bit K/V at head sizes
    64 and 96; fp32 tails; windows that start inside a block; the engine's pool of int8 codes)."""
    torch.manual_seed(3)
    length = 1000
    cases = []
    for k_dtype, v_dtype, dim, heads in ((SinkInt8(), "int8", 64, 9), ("int4", "int4", 64, 9), ("int4", "int4", 96, 15)):
        keys, values = torch.randn(1, 3, length, dim) * 2, torch.randn(1, 3, length, dim)
        cases.append((*filled_cache(k_dtype, v_dtype, length, keys, values), torch.randn(heads, dim)))

    def run() -> list[torch.Tensor]:
        pool = [engine_pool_attention(window) for window in (0, 250)]
        return [attend(cache, attention, q, start) for cache, attention, q in cases for start in (0, 300)] + pool

    threads = torch.get_num_threads()
    try:
        outputs = {}
        for count in (1, 2):
            torch.set_num_threads(count)
            outputs[f"{count} threads"] = run()
    finally:
        torch.set_num_threads(threads)
    for name, flags in instruction_sets().items():
        build(tmp_path / f"{name}.so", flags)
        library = open_library(tmp_path / f"{name}.so")
        for _, attention, _ in cases:
            attention.library = library
        monkeypatch.setattr(paged_codes_batch, "load", lambda: library)
        outputs[name] = run()
    first = next(iter(outputs.values()))
    for name, out in outputs.items():
        assert all(torch.equal(a, b) for a, b in zip(out, first)), name


def test_codecs_the_kernel_cannot_read_keep_the_update_path() -> None:
    spec = CacheSpec(num_layers=1, num_kv_heads=1, head_dim=64)
    for k_dtype, v_dtype in READABLE:
        assert quantized_decode_view.supports(QuantizedCache(spec, 8, 8, k_dtype, v_dtype))
    assert quantized_decode_view.supports(kvquant3_cache(spec, 8, 8))
    assert not quantized_decode_view.supports(QuantizedCache(spec, 8, 8, "int3", "int8"))
    assert not quantized_decode_view.supports(QuantizedCache(spec, 8, 8, "int8", "int3"))


@pytest.fixture(scope="module")
def q4_models() -> dict[str, LLM]:
    return {}


def greedy(llm: LLM, cache: QuantizedCache, prompt: torch.Tensor, steps: int) -> tuple[list[int], torch.Tensor]:
    tokens, logits = [], []
    with torch.inference_mode():
        last = llm.model(prompt, cache)[:, -1]
        for _ in range(steps):
            token = last.argmax(-1, keepdim=True)
            tokens.append(int(token))
            last = llm.model(token, cache)[:, -1]
            logits.append(last[0])
    return tokens, torch.stack(logits)


@pytest.mark.parametrize("model,prompt_length,k_dtype,v_dtype", [
    ("smollm2", 100, "int8", "int8"), ("smollm2", 100, "int4", "int4"), ("smollm2", 100, "fp16", "fp8"),
    ("smollm2", 100, "kvquant3", "kvquant3"),
    ("gemma3-270m", 600, "int4", "int4"),  # head_dim 256, and local layers whose 512-token window is passed
])  # fmt: skip
def test_models_decode_over_the_codes_as_through_update(q4_models: dict[str, LLM], model: str, prompt_length: int,
                                                        k_dtype: str, v_dtype: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """Greedy tokens over 64 steps past the prompt (packing blocks on the way) equal the update
    path's, and the decode steps never assemble the history."""
    if model not in q4_models:
        q4_models[model] = LLM.load(model_path(model), progress=False, weights="q4")
    llm, steps = q4_models[model], 64
    prompt = torch.randint(100, 20000, (1, prompt_length), generator=torch.Generator().manual_seed(7))

    def cache() -> QuantizedCache:
        size = prompt_length + steps + 1
        return build_quantized_cache(llm.model, llm.tokenizer, size, size, k_dtype, v_dtype)

    with monkeypatch.context() as patch:
        patch.setattr(quantized_decode_view, "supports", lambda cache: False)
        expected_tokens, expected_logits = greedy(llm, cache(), prompt, steps)

    over_codes = cache()
    assembled: list[int] = []
    real_assemble = over_codes._assemble
    monkeypatch.setattr(over_codes, "_assemble", lambda layer, end: assembled.append(end) or real_assemble(layer, end))
    tokens, logits = greedy(llm, over_codes, prompt, steps)
    assert set(assembled) == {prompt_length}, "only the prompt's torch prefill reads the history back"
    assert over_codes.num_packed_blocks == (prompt_length + steps - 32) // 32
    assert tokens == expected_tokens
    # The same attention summed in another order; 4-bit weights round activations to int8 per
    # block, which turns last-bit differences into logit noise of this size (see test_fast_decode).
    assert (logits - expected_logits).abs().max() < 2.0
