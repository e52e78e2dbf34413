"""A QuantizedCache's decode view: what the one-call C decode step (kernels/quantized_attention.c,
`kvgen_decode_layers_over_codes`) needs to attend over the cache's stored codes, with no fp32 copy
of the history. The step writes the new key and value into the cache's fp32 tail (or sink) slot,
and attention decodes one block of codes at a time per kv head (kvquant3's pre-RoPE keys rotated
back with tables of the cache's RoPE), scores it and moves on.
"""

from __future__ import annotations

import ctypes
from typing import Any, Protocol

import torch

from kvgen.kernels import load as library
from kvgen.kv.codes_layout import PackedCodes, describe, kernel_reads, rope_tables
from kvgen.kv.codecs import Codec
from kvgen.kv.interface import CacheSpec
from kvgen.kv.kvquant import KVQuantKeyCodec
from kvgen.kv.packed import PackedStore


class QuantizedCache(Protocol):
    """What this module reads of kv/quantized.py's QuantizedCache (which imports this module)."""

    spec: CacheSpec
    key_codec: Codec
    value_codec: Codec
    key_store: PackedStore
    value_store: PackedStore
    key_rope: Any
    keys_stored_before_rope: bool
    sink_tokens: int
    block_tokens: int

    @property
    def capacity(self) -> int: ...
    @property
    def sink_store(self) -> torch.Tensor: ...
    @property
    def tail_store(self) -> torch.Tensor: ...
    @property
    def num_packed_blocks(self) -> int: ...
    def reserve(self, end: int) -> None: ...

_ptr, _i64 = ctypes.c_void_p, ctypes.c_int64


def supports(cache: QuantizedCache) -> bool:
    if cache.keys_stored_before_rope and (not isinstance(cache.key_codec, KVQuantKeyCodec) or cache.key_rope is None):
        return False
    return kernel_reads(cache.key_codec, cache.value_codec, cache.spec.head_dim, cache.block_tokens)


class QuantizedKV(ctypes.Structure):  # quantized_attention.c quantized_kv
    _fields_ = [("sink", _ptr), ("sink_kv_stride", _i64), ("sink_layer_stride", _i64), ("sink_head_stride", _i64),
                ("sink_len", _i64), ("tail", _ptr), ("tail_kv_stride", _i64), ("tail_layer_stride", _i64),
                ("tail_head_stride", _i64), ("block_size", _i64), ("key_codes", _ptr), ("value_codes", _ptr)]  # fmt: skip


def _storage_key(cache: QuantizedCache) -> tuple:
    """Changes whenever a tensor the descriptors point into is replaced (grown, rebuilt, forked)."""
    tensors = [*cache.key_store.parts.values(), *cache.value_store.parts.values(), cache.sink_store, cache.tail_store]
    return tuple((t.data_ptr(), t.shape) for t in tensors)


def _rope_tables(cache: QuantizedCache) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Per layer, cos/sin [capacity, D] for keys stored before RoPE; None per layer otherwise."""
    if not cache.keys_stored_before_rope:
        return [None] * cache.spec.num_layers
    assert cache.key_rope is not None
    return rope_tables(cache.key_rope, cache.spec.num_layers, cache.capacity)  # type: ignore[return-value]


class QuantizedDecodeView:
    """The kernel's view of one quantized cache (`storage`), rebuilt only when that storage moves;
    RoPE tables for pre-RoPE keys, rebuilt only when the cache's capacity grows."""

    def __init__(self) -> None:
        self.library = library()
        self.storage = QuantizedKV()
        self._key: tuple | None = None
        self._codes: tuple[ctypes.Array, ctypes.Array] | None = None  # per layer K, V; `storage` points into them
        self._rope_key: tuple | None = None
        self._ropes: list[tuple[torch.Tensor, torch.Tensor] | None] = []  # the key descriptors point into them

    def prepare(self, cache: QuantizedCache, end: int) -> None:
        """Make room for positions up to `end` (so this step's writes move nothing), then point
        `storage` at the cache."""
        cache.reserve(end)
        key = (id(cache), _storage_key(cache))
        if key == self._key:
            return
        rope_key = (cache.key_rope, cache.capacity) if cache.keys_stored_before_rope else None
        if rope_key != self._rope_key or not self._ropes:
            self._ropes, self._rope_key = _rope_tables(cache), rope_key
        layers = range(cache.spec.num_layers)
        keys = (PackedCodes * len(layers))(*(describe(cache.key_store, layer, self._ropes[layer]) for layer in layers))
        values = (PackedCodes * len(layers))(*(describe(cache.value_store, layer, None) for layer in layers))
        sink, tail = cache.sink_store, cache.tail_store
        self.storage = QuantizedKV(
            sink.data_ptr(), sink.stride(0), sink.stride(1), sink.stride(2), cache.sink_tokens,
            tail.data_ptr(), tail.stride(0), tail.stride(1), tail.stride(2), cache.block_tokens,
            ctypes.addressof(keys), ctypes.addressof(values),
        )  # fmt: skip
        self._codes, self._key = (keys, values), key

    def attend(self, cache: QuantizedCache, layer: int, q: int, out: int, heads: int, scale: float, start: int,
               end: int) -> None:  # fmt: skip
        """One layer's attention alone, after `prepare`: out [heads, D] = attention of q [heads, D]
        (addresses) over positions start..end-1 (the decode step runs it inside
        kvgen_decode_layers_over_codes)."""
        assert self._codes is not None
        sink, tail, spec = cache.sink_store, cache.tail_store, cache.spec
        self.library.kvgen_quantized_decode_attention(
            q, out, heads, spec.num_kv_heads, spec.head_dim, scale, sink[0, layer].data_ptr(),
            sink[1, layer].data_ptr(), sink.stride(2), cache.sink_tokens, ctypes.byref(self._codes[0][layer]),
            ctypes.byref(self._codes[1][layer]), cache.num_packed_blocks, cache.block_tokens,
            tail[0, layer].data_ptr(), tail[1, layer].data_ptr(), tail.stride(2), start, end,
        )  # fmt: skip
