"""QuantizedCache: which positions are rounded when, and through which codec."""

from __future__ import annotations

import pytest
import torch

from kvgen import CacheConfig
from kvgen.kv import CacheSpec
from kvgen.kv.codecs import CODECS, KIVI_GROUP
from kvgen.kv.quantized import QuantizedCache

SPEC = CacheSpec(num_layers=1, num_kv_heads=2, head_dim=32)


def append(cache: QuantizedCache, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = cache.update(0, values, values.clone())
    cache.commit(values.shape[2])
    return out


def test_recent_window_stays_exact_and_older_positions_are_rounded() -> None:
    torch.manual_seed(0)
    cache = QuantizedCache(SPEC, 64, 64, k_dtype="int8", v_dtype="int8", residual=4)
    x = torch.randn(1, 2, 10, 32)
    keys, values = append(cache, x)
    torch.testing.assert_close(keys[:, :, 6:], x[:, :, 6:], rtol=0, atol=0)  # last 4: full precision
    torch.testing.assert_close(keys[0, :, :6], CODECS["int8"].round(x[0, :, :6]), rtol=0, atol=0)
    assert not torch.equal(keys[:, :, :6], x[:, :, :6])


def test_kivi_keys_wait_for_a_whole_group_of_tokens() -> None:
    torch.manual_seed(1)
    cache = QuantizedCache(SPEC, 128, 128, k_dtype="int4", v_dtype="int4", residual=0)
    x = torch.randn(1, 2, KIVI_GROUP + 5, 32)
    keys, values = append(cache, x)
    group = x[0, :, :KIVI_GROUP]
    torch.testing.assert_close(keys[0, :, :KIVI_GROUP], CODECS["int4-kivi-keys"].round(group), rtol=0, atol=0)
    torch.testing.assert_close(keys[:, :, KIVI_GROUP:], x[:, :, KIVI_GROUP:], rtol=0, atol=0)  # partial group
    torch.testing.assert_close(values[0], CODECS["int4"].round(x[0]), rtol=0, atol=0)  # per token: all rounded


def test_stored_bytes_per_token() -> None:
    cache = QuantizedCache(SPEC, 8, 8, k_dtype="int4", v_dtype="fp16")
    assert cache.stored_bytes_per_token == 2 * 32 * (5 + 16) / 8


def test_config_rejects_unknown_dtype() -> None:
    with pytest.raises(ValueError, match="unknown KV dtype 'int5'"):
        CacheConfig("quantized", k_dtype="int5")
