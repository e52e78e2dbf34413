"""QuantizedCache: K and V rounded through separate codecs, with a full-precision recent window.

Positions older than the last `residual` tokens are rounded exactly as the codec stores them (KIVI
keeps the most recent tokens in full precision; its per-channel key groups are rounded once a whole
group has left that window). Attention reads an fp32 mirror holding the rounded values, so outputs
are those of the quantized storage, but the packed storage itself and a kernel that attends over it
are not built yet: memory_bytes() reports the fp32 mirror, and `stored_bytes_per_token` what the
codecs would keep.
"""

from __future__ import annotations

import torch

from kvgen.kv.contiguous import ContiguousCache
from kvgen.kv.codecs import Codec, key_codec, value_codec
from kvgen.kv.interface import CacheSpec, KVCache


class QuantizedCache(KVCache):
    def __init__(self, spec: CacheSpec, capacity: int, max_capacity: int, k_dtype: str, v_dtype: str, residual: int = 32):
        self.spec = spec
        self.key_codec, self.value_codec = key_codec(k_dtype), value_codec(v_dtype)
        self.residual = residual
        self.mirror = ContiguousCache(spec, capacity, max_capacity=max_capacity)
        self._rounded = [[0, 0] for _ in range(spec.num_layers)]  # per layer: positions rounded in K, V

    @property
    def seq_len(self) -> int:
        return self.mirror.seq_len

    @property
    def capacity(self) -> int:
        return self.mirror.capacity

    @property
    def stored_bytes_per_token(self) -> float:
        values_per_token = self.spec.num_layers * self.spec.num_kv_heads * self.spec.head_dim
        return values_per_token * (self.key_codec.bits_per_value + self.value_codec.bits_per_value) / 8

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        all_keys, all_values = self.mirror.update(layer, keys, values)  # [1, H, L, D] views
        end = all_keys.shape[2]
        for index, (codec, stored) in enumerate(((self.key_codec, all_keys), (self.value_codec, all_values))):
            self._rounded[layer][index] = self._round_ready(codec, stored, self._rounded[layer][index], end)
        return all_keys, all_values

    def _round_ready(self, codec: Codec, stored: torch.Tensor, rounded: int, end: int) -> int:
        """Round, in place, whole groups that have left the full-precision window; new boundary."""
        ready = max(0, end - self.residual)
        ready -= (ready - rounded) % codec.group_tokens
        if ready > rounded:
            block = stored[0, :, rounded:ready]  # [H, n, D]
            stored[0, :, rounded:ready] = codec.round(block)
        return max(rounded, ready)

    def commit(self, num_tokens: int) -> None:
        self.mirror.commit(num_tokens)

    def truncate(self, num_tokens: int) -> None:
        self.mirror.truncate(num_tokens)
        for marks in self._rounded:
            marks[0], marks[1] = min(marks[0], num_tokens), min(marks[1], num_tokens)

    def copy_prefix(self, source: KVCache, num_tokens: int) -> None:
        self._check_copy_source(source, num_tokens)
        assert isinstance(source, QuantizedCache)
        if (source.key_codec, source.value_codec, source.residual) != (self.key_codec, self.value_codec, self.residual):
            raise ValueError("copy_prefix between quantized caches needs the same codecs and residual window")
        self.mirror.copy_prefix(source.mirror, num_tokens)
        self._rounded = [[min(k, num_tokens), min(v, num_tokens)] for k, v in source._rounded]

    def fork(self) -> "QuantizedCache":
        twin = QuantizedCache.__new__(QuantizedCache)
        twin.spec, twin.key_codec, twin.value_codec, twin.residual = self.spec, self.key_codec, self.value_codec, self.residual
        twin.mirror = self.mirror.fork()
        twin._rounded = [list(marks) for marks in self._rounded]
        return twin

    def memory_bytes(self) -> int:
        return self.mirror.memory_bytes()
