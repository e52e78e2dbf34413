"""Decode attention over a QuantizedCache's stored codes (kernels/quantized_attention.c) computes
what softmax attention over the decoded history computes, and the C decode step uses it without
ever decoding the history into the cache's scratch buffer."""

from __future__ import annotations

import math

import pytest
import torch

from kvgen import LLM
from kvgen.kernels import load
from kvgen.kv.codecs import Int8Codec
from kvgen.kv.interface import CacheSpec
from kvgen.cache_factory import build_quantized_cache
from kvgen.kv.kvquant import KVQuantKeyCodec, KVQuantValueCodec
from kvgen.kv.quantized import QuantizedCache
from kvgen.kv import quantized_decode_view
from kvgen.kv.quantized_decode_view import QuantizedDecodeView
from tests.support.models import model_path

pytestmark = pytest.mark.skipif(load() is None, reason="the kernel needs a C compiler")

READABLE = [("int8", "int8"), ("int4", "int4"), ("fp16", "fp8"), ("bf16", "fp32"), ("fp32", "int4"), ("fp8", "fp16")]


class SinkInt8(Int8Codec):
    """int8 that keeps the first position whole, as kvquant3 does (exercises the sink segment)."""

    sink_tokens = 1


def toy_rope(layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama-style RoPE tables [N, 64], a different base per layer (as Gemma's local/global layers)."""
    inverse = 1.0 / (10000.0 * (1 + layer)) ** (torch.arange(0, 64, 2).float() / 64)
    angles = positions.float()[:, None] * inverse
    return torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()


def kvquant3_cache(spec: CacheSpec, capacity: int, max_capacity: int) -> QuantizedCache:
    """kvquant3 keys (per-channel codebook, 1 exact outlier per position, before RoPE) and values,
    with made-up sorted codebooks: the kernel must read whatever levels calibration produced."""
    levels = torch.rand(spec.num_layers, 8, generator=torch.Generator().manual_seed(1)).sort(-1).values
    levels[:, 0], levels[:, -1] = 0.0, 1.0
    keys, values = KVQuantKeyCodec(levels.contiguous(), outliers=1), KVQuantValueCodec(levels.flip(-1).neg().add(1).contiguous())
    return QuantizedCache(spec, capacity, max_capacity, keys, values, key_rope=toy_rope)


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """Softmax attention of q [heads, D] over keys/values [H_kv, L, D] from `start`, grouped heads."""
    heads, dim = q.shape
    kv_heads = keys.shape[0]
    scores = q.view(kv_heads, heads // kv_heads, dim) @ keys[:, start:].transpose(1, 2) / math.sqrt(dim)
    return (torch.softmax(scores, -1) @ values[:, start:]).reshape(heads, dim)


@pytest.mark.parametrize("k_dtype,v_dtype", [*READABLE, (SinkInt8(), "int4"), ("kvquant3", "kvquant3")])
@pytest.mark.parametrize("length,start", [(1, 0), (7, 0), (64, 0), (100, 0), (333, 0), (333, 280), (333, 150)])
def test_attention_over_codes_equals_attention_over_the_decoded_history(k_dtype, v_dtype, length: int, start: int) -> None:
    torch.manual_seed(length + start)
    spec, heads = CacheSpec(num_layers=2, num_kv_heads=3, head_dim=64), 9
    if k_dtype == "kvquant3":
        cache = kvquant3_cache(spec, 64, 1024)
    else:
        cache = QuantizedCache(spec, 64, 1024, k_dtype, v_dtype)
    keys, values = torch.randn(1, 3, length, 64) * 2, torch.randn(1, 3, length, 64)
    keys[..., 5] += 8  # an outlier channel, as real keys have
    for layer in range(2):
        cache.update(layer, keys[:, :, :-1], values[:, :, :-1])
    cache.commit(length - 1)
    attention = QuantizedDecodeView()
    attention.prepare(cache, length)
    cache.write(1, keys[:, :, -1:], values[:, :, -1:])
    q, out = torch.randn(heads, 64), torch.full((heads, 64), float("nan"))
    attention.attend(cache, 1, q.data_ptr(), out.data_ptr(), heads, 1 / math.sqrt(64), start, length)
    decoded_keys, decoded_values = cache._assemble(1, length)  # what the torch path reads
    expected = reference(q, decoded_keys[0], decoded_values[0], start)
    assert cache.num_packed_blocks == max(0, (length - 1 - cache.sink_tokens - 32) // 32)
    assert torch.allclose(out, expected, atol=1e-5, rtol=1e-5), (out - expected).abs().max()


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
