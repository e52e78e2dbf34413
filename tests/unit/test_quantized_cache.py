"""QuantizedCache: what is packed when, how much rounding each codec does, and what memory it holds."""

from __future__ import annotations

import pytest
import torch

from kvgen import CacheConfig
from kvgen.kv import CacheSpec, ContiguousCache
from kvgen.kv.codecs import BLOCK_TOKENS, CHANNEL_GROUP, CODECS, CastCodec, value_codec
from kvgen.kv.quantized import QuantizedCache
from kvgen.models.rotary import RotaryEmbedding, apply_rotary, inverse_frequencies

SPEC = CacheSpec(num_layers=1, num_kv_heads=2, head_dim=64)


def append(cache: QuantizedCache, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = cache.update(0, x, x.clone())
    cache.commit(x.shape[2])
    return out


def group_range(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """max - min over groups of `size` along `dim`, broadcast back to x's shape."""
    moved = x.movedim(dim, -1)
    grouped = moved.reshape(*moved.shape[:-1], -1, size)
    spread = (grouped.amax(-1, keepdim=True) - grouped.amin(-1, keepdim=True)).expand_as(grouped)
    return spread.reshape(moved.shape).movedim(-1, dim)


def bound(name: str, x: torch.Tensor) -> torch.Tensor:
    """The largest error each codec's format allows, per element of x [H, S, D] (fp16 scales add ~1e-3)."""
    amax = x.abs().amax(-1, keepdim=True)
    slack = 1.002
    return {
        "fp16": x.abs() * 2**-11,
        "bf16": x.abs() * 2**-8,
        "fp8": torch.maximum(x.abs() * 2**-4, amax / 448 * 2**-9) * slack,  # 3 mantissa bits
        "int8": amax / 127 / 2 * slack,
        "int4": group_range(x, -1, CHANNEL_GROUP) / 15 / 2 * slack,
        "int4-kivi-keys": group_range(x, 1, BLOCK_TOKENS) / 15 / 2 * slack,
        "int3": group_range(x, -1, CHANNEL_GROUP) / 7 / 2 * slack,
    }[name] + 1e-6


@pytest.mark.parametrize("name", ["fp16", "bf16", "fp8", "int8", "int4", "int4-kivi-keys", "int3"])
def test_packed_round_trip_is_within_the_codec_bound(name: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 2 * BLOCK_TOKENS, 64) * torch.linspace(0.1, 20, 64)  # outlier-ish channels
    error = (CODECS[name].round(x) - x).abs()
    assert (error <= bound(name, x)).all(), f"{name}: worst excess {(error - bound(name, x)).max():.3g}"
    assert error.max() > 0  # really rounded, not kept as fp32


@pytest.mark.parametrize(("name", "code_bytes"), [("int4", 32), ("int4-kivi-keys", 32), ("int3", 24), ("int8", 64)])
def test_codes_are_really_packed(name: str, code_bytes: int) -> None:
    parts = CODECS[name].encode(torch.randn(2, 3, BLOCK_TOKENS, 64), 0)
    assert parts["codes"].shape == (2, 3, BLOCK_TOKENS, code_bytes)  # 64 values per position
    assert parts["codes"].element_size() == 1


def test_recent_window_stays_exact_and_whole_blocks_are_packed() -> None:
    torch.manual_seed(0)
    cache = QuantizedCache(SPEC, 128, 128, k_dtype="int8", v_dtype="int8", residual=4)
    x = torch.randn(1, 2, 70, 64)
    keys, _ = append(cache, x)  # during the pass: everything still exact
    torch.testing.assert_close(keys, x, rtol=0, atol=0)
    assert cache.packed_end == 64  # two whole blocks have left the 4-token window
    keys, _ = cache.update(0, x[:, :, :1], x[:, :, :1])
    torch.testing.assert_close(keys[0, :, :64], CODECS["int8"].round(x[0, :, :64]), rtol=0, atol=0)
    torch.testing.assert_close(keys[:, :, 64:70], x[:, :, 64:], rtol=0, atol=0)  # the tail: full precision


def test_memory_holds_packed_codes_not_an_fp32_copy() -> None:
    spec = CacheSpec(num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2's shape
    tokens = 2048
    fp32 = ContiguousCache(spec, tokens)
    int4 = QuantizedCache(spec, tokens, tokens, "int4", "int4")
    x = torch.randn(1, 3, tokens, 64)
    for layer in range(30):
        int4.update(layer, x, x)
    int4.commit(tokens)
    stored = int4.key_store.nbytes() + int4.value_store.nbytes()
    assert stored == fp32.memory_bytes() * 5 / 32  # 4-bit codes + fp16 step/offset per 32 values
    # Also held: one layer of fp32 scratch (1/30) and the fp32 tail (< 64 positions).
    scratch, tail = 2 * 3 * tokens * 64 * 4, 2 * 30 * 3 * 64 * 64 * 4
    assert int4.memory_bytes() == stored + scratch + tail
    assert int4.memory_bytes() < 0.23 * fp32.memory_bytes()


def test_keys_before_rope_are_stored_unrotated_and_read_rotated() -> None:
    rope = RotaryEmbedding(inverse_frequencies(64, 10000.0, None))
    codec = CastCodec("fp32", torch.float32)
    codec.keys_before_rope = True

    def key_rope(layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rope(positions[None], torch.float32)
        return cos[0, 0], sin[0, 0]

    cache = QuantizedCache(SPEC, 128, 128, codec, "fp32", residual=0, key_rope=key_rope)
    raw = torch.randn(1, 2, 40, 64)
    rotated = apply_rotary(raw, *rope(torch.arange(40)[None], torch.float32))
    append(cache, rotated)
    stored = cache.key_store.parts["x"][0, :, 0]  # [H, B, D]: the first packed block
    torch.testing.assert_close(stored, raw[0, :, :BLOCK_TOKENS], rtol=0, atol=1e-5)
    keys, _ = cache.update(0, rotated[:, :, :1], rotated[:, :, :1])
    torch.testing.assert_close(keys[:, :, :40], rotated, rtol=0, atol=1e-5)


def test_bad_input_is_refused_and_changes_nothing() -> None:
    cache = QuantizedCache(SPEC, 64, 64, "int4", "int4", residual=0)
    x = torch.randn(1, 2, 40, 64)
    append(cache, x)
    before = (cache.seq_len, cache.packed_end, cache.memory_bytes())
    with pytest.raises(ValueError, match="one sequence"):
        cache.update(0, torch.randn(2, 2, 1, 64), torch.randn(2, 2, 1, 64))
    with pytest.raises(ValueError, match="limited to 64"):
        cache.update(0, torch.randn(1, 2, 30, 64), torch.randn(1, 2, 30, 64))
    assert (cache.seq_len, cache.packed_end, cache.memory_bytes()) == before
    with pytest.raises(ValueError, match="pass key_rope"):
        QuantizedCache(SPEC, 8, 8, _pre_rope_codec(), "fp32")
    with pytest.raises(ValueError, match="calibrated on a model"):
        value_codec("kvquant3")


def _pre_rope_codec() -> CastCodec:
    codec = CastCodec("fp32", torch.float32)
    codec.keys_before_rope = True
    return codec


def test_stored_bytes_per_token() -> None:
    cache = QuantizedCache(SPEC, 8, 8, k_dtype="int4", v_dtype="fp16")
    assert cache.stored_bytes_per_token == 2 * 64 * (5 + 16) / 8


def test_config_rejects_unknown_dtype() -> None:
    with pytest.raises(ValueError, match="unknown KV dtype 'int5'"):
        CacheConfig("quantized", k_dtype="int5")
