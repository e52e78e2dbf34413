"""int8 keys are stored in groups of 16 (or fewer) keys per channel quad (codecs.Int8KeyCodec), and
every reader agrees with that layout: the torch decode, the attention kernel's integer key scores
(VNNI, AVX2 and scalar builds alike) and its decode_tile, after truncate, remove_range and fork as
well as after plain writes. A reader that took the codes as rows would read other keys' bytes and
miss the float reference by the size of a key, not by 1e-5."""

from __future__ import annotations

import math

import pytest
import torch

from kvgen.kernels import load
from kvgen.kv.codecs import CODECS, Int8KeyCodec, key_codec, key_group
from kvgen.kv.interface import CacheSpec
from kvgen.kv.quantized import QuantizedCache
from kvgen.kv.quantized_decode_view import QuantizedDecodeView

pytestmark = pytest.mark.skipif(load() is None, reason="the kernel needs a C compiler")


@pytest.mark.parametrize("block_tokens", [32, 24, 12, 6, 5])
def test_codes_sit_in_key_groups_of_channel_quads(block_tokens: int) -> None:
    x = torch.randn(2, 3, block_tokens, 64)
    rows = CODECS["int8"].encode(x, 0)
    stored = key_codec("int8").encode(x, 0)
    group = key_group(block_tokens)
    assert group == {32: 16, 24: 8, 12: 4, 6: 2, 5: 1}[block_tokens]
    assert stored["codes"].shape == (2, 3, block_tokens // group, 16, group, 4)
    for position, channel in ((0, 0), (block_tokens - 1, 63), (block_tokens // 2, 37)):
        byte = stored["codes"][:, :, position // group, channel // 4, position % group, channel % 4]
        assert torch.equal(byte, rows["codes"][:, :, position, channel])
    assert torch.equal(key_codec("int8").decode(stored, 0), CODECS["int8"].decode(rows, 0))
    assert key_codec("int8").format_name != CODECS["int8"].format_name  # blocks on disk name their layout
    with pytest.raises(ValueError, match="multiple of 4"):
        Int8KeyCodec().encode(torch.randn(1, 1, 32, 6), 0)


def exact_query(heads: int, dim: int) -> torch.Tensor:
    """A query whose int16 codes are exactly itself (max |code| 32512, step 2^-12), pre-divided by
    sqrt(dim): integer key scores then equal the float reference to rounding of the sums."""
    codes = torch.randint(-32512, 32513, (heads, dim)).float()
    codes[:, 0] = 32512
    return codes * 2.0**-12 / math.sqrt(dim)


def attend_all(cache: QuantizedCache, q: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output, softmax over the torch-decoded history) for the cache's last layer, over
    positions start..seq_len-1 (everything committed, nothing new written)."""
    view = QuantizedDecodeView()
    view.prepare(cache, cache.seq_len)
    out, layer = torch.full_like(q, float("nan")), cache.spec.num_layers - 1
    view.attend(cache, layer, q.data_ptr(), out.data_ptr(), q.shape[0], 1 / math.sqrt(q.shape[1]), start, cache.seq_len)
    keys, values = (t[0] for t in cache._assemble(layer, cache.seq_len))
    kv_heads, dim = keys.shape[0], keys.shape[-1]
    scores = q.view(kv_heads, -1, dim) @ keys[:, start:].transpose(1, 2) / math.sqrt(dim)
    return out, (torch.softmax(scores, -1) @ values[:, start:]).reshape(q.shape)


@pytest.mark.parametrize("block_tokens", [32, 24, 12, 6])
def test_kernel_scores_equal_the_decoded_keys_after_truncate_remove_range_and_fork(block_tokens: int) -> None:
    torch.manual_seed(block_tokens)
    spec = CacheSpec(num_layers=2, num_kv_heads=3, head_dim=64)
    cache = QuantizedCache(spec, 64, 4096, "int8", "fp32", block_tokens=block_tokens)
    length = 700
    keys, values = torch.randn(1, 3, length, 64) * 2, torch.randn(1, 3, length, 64)
    for layer in range(2):
        cache.update(layer, keys, values)
    cache.commit(length)
    q = exact_query(9, 64)

    def check(cache: QuantizedCache) -> None:
        for start in (0, 150, cache.seq_len - 45):  # windows starting inside a block and inside a group
            out, expected = attend_all(cache, q, start)
            assert torch.allclose(out, expected, atol=1e-5, rtol=1e-5), (out - expected).abs().max()

    check(cache)
    before = cache._assemble(1, length)[0][0].clone()  # [H, L, D] as stored
    cache.truncate(500 + block_tokens // 2 + 1)  # into a block: its start goes back to the tail
    for layer in range(2):
        cache.update(layer, keys[:, :, cache.seq_len :], values[:, :, cache.seq_len :])
    cache.commit(length - cache.seq_len)
    check(cache)
    twin = cache.fork()
    twin.remove_range(200 + 3, 260, lambda layer, k, delta: k)  # keys kept as stored before 203, re-packed after
    after = twin._assemble(1, twin.seq_len)[0][0]
    assert torch.equal(after[:, :203], before[:, :203])  # codes moved as stored, into the new layout
    assert torch.allclose(after[:, 203:], before[:, 260:], atol=0.05)  # re-encoded once more: int8 rounding
    check(twin)
    check(cache)  # the fork's rebuild left the source alone
